"""Chaos tests: failover at scale (servers killed or stalled during generations and fine-tuning
steps), sessions through a lossy network, and the soak runner."""
