"""The actors of callboard: ingest, router, queue, model, aggregator, jobs, and their base."""
