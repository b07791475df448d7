"""Client tests: sequence manager, inference sessions, forward/backward, the bridge."""
