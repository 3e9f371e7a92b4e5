"""The actors of callboard: router, queue, model, aggregator, jobs, their base, and the
front door (ingest: admission on the submitting thread, not an actor)."""
