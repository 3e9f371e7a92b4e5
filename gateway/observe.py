"""What an operator watches: ``GET /metrics`` (Prometheus) and the dashboard at ``/``.

Filled in by issue 16's observability step; ``routes`` is what ``Front.app`` mounts.
"""

from __future__ import annotations

from aiohttp import web

from callboard import AsyncSystem

__all__ = ["routes"]


def routes(cb: AsyncSystem) -> list[web.RouteDef]:
    """The observability routes over ``cb`` (started)."""
    del cb
    return []
