"""Routing policy (pure): where a task *may* go.

Theory of operation. A request names a model, or a route (a tier/alias such
as ``fast``), or neither (the default route). The policy turns that into a
``Plan``: ``candidates`` (the models that may serve it now; the queue gives
it to whichever of them has credit first, which balances load across the
deployments of one group) and ``fallbacks`` (tried in order when every
candidate failed or is open). Models whose context window cannot hold the
estimated prompt plus ``max_tokens`` are never candidates.

What must hold: a plan never names an unknown model; candidates are never
empty (no fit is a typed ``NoRoute``); fallbacks never repeat a candidate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from callboard.messages import Request, UnknownModelError

from .settings import ModelSettings


class NoRoute(Exception):  # noqa: N818 - a decision, named as the outcome
    """No configured model can serve this request (e.g. it fits no context window)."""


@dataclass(frozen=True, slots=True)
class Plan:
    candidates: tuple[str, ...]
    fallbacks: tuple[str, ...]


class RoutingPolicy:
    """Explicit model, named routes (tiers), default route; context-window fit."""

    def __init__(
        self,
        models: Mapping[str, ModelSettings],
        *,
        default_route: tuple[str, ...] | None = None,
        routes: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        if not models:
            raise ValueError("routing needs at least one model")
        self._models = dict(models)
        table: dict[str, list[str]] = {}
        for m in models.values():
            for tier in m.tiers:
                table.setdefault(tier, []).append(m.name)
        for name, members in (routes or {}).items():
            table[name] = list(members)
        self._routes = {k: tuple(v) for k, v in table.items()}
        self._default = default_route or (next(iter(models)),)
        for name, members in [*self._routes.items(), ("default", self._default)]:
            for member in members:
                if member not in self._models:
                    raise UnknownModelError(f"route {name!r} names unknown model {member!r}")

    @property
    def routes(self) -> Mapping[str, tuple[str, ...]]:
        return self._routes

    def check(self, request: Request) -> None:
        """Raise ``UnknownModelError`` if the request names what is not configured."""
        if request.model is not None and request.model not in self._models:
            known = ", ".join(sorted(self._models))
            raise UnknownModelError(f"unknown model {request.model!r} (configured: {known})")
        if request.route is not None and request.route not in self._routes:
            known = ", ".join(sorted(self._routes)) or "none"
            raise UnknownModelError(f"unknown route {request.route!r} (configured: {known})")

    def plan(self, request: Request, prompt_tokens: int) -> Plan:
        self.check(request)
        if request.model is not None:
            wanted: tuple[str, ...] = (request.model,)
        elif request.route is not None:
            wanted = self._routes[request.route]
        else:
            wanted = self._default
        need = prompt_tokens + request.max_tokens
        candidates = tuple(m for m in wanted if self._models[m].context_window >= need)
        fallbacks: list[str] = []
        for m in wanted:
            for fb in self._models[m].fallbacks:
                fits = self._models[fb].context_window >= need
                if fits and fb not in candidates and fb not in fallbacks:
                    fallbacks.append(fb)
        if not candidates:
            if not fallbacks:
                raise NoRoute(
                    f"no model fits {need} tokens (prompt ~{prompt_tokens} + max_tokens "
                    f"{request.max_tokens}); largest context: "
                    f"{max(self._models[m].context_window for m in wanted)}"
                )
            candidates, fallbacks = (fallbacks[0],), fallbacks[1:]
        return Plan(candidates=candidates, fallbacks=tuple(fallbacks))
