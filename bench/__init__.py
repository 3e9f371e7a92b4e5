"""The simulated provider and the load harness."""
