"""Tests of the public test kit (petals_core.testing)."""
