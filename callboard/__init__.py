"""callboard: schedule LLM API calls with actors."""
