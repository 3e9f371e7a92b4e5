"""The simulated OpenAI-compatible provider.

The embedded default when no provider is configured, and the bench's server
(``callboard mock``).
"""
