"""The load harness: ``callboard bench`` against the simulated provider and raw-client baselines."""
