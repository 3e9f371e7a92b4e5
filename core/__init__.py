"""The pure decision cores.

Breaker, limiter, priority queue, routing, fallbacks, retry, money, tokens,
stats and schedules.

Nothing here imports pykka, threads or HTTP, or reads a clock: every time is
passed in. The actors (``callboard.actors``) drive these cores and carry out
what they decide.
"""
