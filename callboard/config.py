"""System configuration: the models, routes, queue and supervision settings.

``SystemConfig()`` with no models means "run on the built-in simulated
provider": ``System()`` then starts one on 127.0.0.1 and configures two
models on it (``sim-fast``, cheap; ``sim-smart``, stronger and dearer), each
the other's fallback, so everything works on a fresh machine with no keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Final

from callboard.actors.pricing import Price
from callboard.actors.settings import ModelSettings, SchedulerSettings
from callboard.messages import ConfigError
from callboard.supervisor.supervisor import SupervisorConfig

RUN_SWITCH_INTERVAL_S: Final = 0.0005
"""The GIL switch interval ``callboard run`` and the bench use (see ``SystemConfig``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetSettings:
    """Spend limits in USD, enforced by reservation before each call."""

    total_usd: Decimal | None = None
    per_tag_usd: Mapping[str, Decimal] = field(default_factory=dict)
    """Limits per ``budget_tag`` (tenant, team); other tags count only to the total."""
    downgrade_when_tight: bool = True
    """Route to a cheaper model of the plan when the first choice no longer fits."""
    stop_when_spent: bool = False
    """Stop the whole system once the total budget is spent."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_tag_usd", MappingProxyType(dict(self.per_tag_usd)))
        for name, value in [("total_usd", self.total_usd), *self.per_tag_usd.items()]:
            if value is not None and not (isinstance(value, Decimal | int) and value >= 0):
                raise ConfigError(f"budget {name} must be a non-negative Decimal, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.total_usd is not None or bool(self.per_tag_usd)


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemConfig:
    models: tuple[ModelSettings, ...] = ()
    """The model deployments; empty means the simulated provider."""
    default_route: tuple[str, ...] | None = None
    """Where requests naming neither a model nor a route go (default: the first model)."""
    routes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Extra named routes (aliases) besides the models' own ``tiers``."""
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    order: str = "cost"
    """How candidates are ordered: cost, cheapest, latency, least_busy or config."""
    escalate_to: str | None = None
    """A model appended as the last fallback of every task."""
    seed: int = 0
    """Seeds retry jitter and the simulated provider, for reproducible runs."""
    switch_interval_s: float | None = None
    """If set, the interpreter's GIL switch interval while the system runs
    (``sys.setswitchinterval``; restored at stop). It is process-wide, so it is
    off unless asked for; ``callboard run`` asks for ``RUN_SWITCH_INTERVAL_S``.
    Every hop between callboard's threads waits for the GIL, up to the interval
    (5 ms by default) when the I/O loop is busy: at 200 calls in flight a
    shorter one lifted throughput from ~0.86x to ~0.90x of the bare client."""

    def __post_init__(self) -> None:
        si = self.switch_interval_s
        if si is not None and (
            isinstance(si, bool)
            or not isinstance(si, int | float)
            or not math.isfinite(si)
            or not 1e-6 <= si <= 1
        ):
            raise ConfigError(
                f"switch_interval_s must be a number of seconds in [1e-6, 1], got {si!r}"
            )
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "routes", MappingProxyType(dict(self.routes)))
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"model names must be unique; repeated: {dupes}")
        known = set(names)
        for m in self.models:
            for fb in m.fallbacks:
                if fb not in known:
                    raise ConfigError(
                        f"model {m.name!r}: fallback {fb!r} is not a configured model"
                    )
        if self.models:
            for route, members in [
                *self.routes.items(),
                ("default_route", self.default_route or ()),
            ]:
                for member in members:
                    if member not in known:
                        raise ConfigError(f"route {route!r} names unknown model {member!r}")

    def _default_models(self) -> tuple[str, ...]:
        """The default route when it names models (not a route name or "auto")."""
        d = self.default_route or ()
        if len(d) == 1 and (d[0] == "auto" or d[0] in self.routes or self._is_tier(d[0])):
            return ()
        return d

    def _is_tier(self, name: str) -> bool:
        return any(name in m.tiers for m in self.models)

    @property
    def simulated(self) -> bool:
        return not self.models


def simulated_models(base_url: str) -> tuple[ModelSettings, ...]:
    """The two default models on the simulated provider."""
    return (
        ModelSettings(
            name="sim-fast",
            base_url=base_url,
            max_concurrency=64,
            price=Price(input_per_mtok=Decimal("0.15"), output_per_mtok=Decimal("0.60")),
            context_window=128_000,
            tiers=("fast", "cheap"),
            fallbacks=("sim-smart",),
        ),
        ModelSettings(
            name="sim-smart",
            base_url=base_url,
            max_concurrency=32,
            price=Price(input_per_mtok=Decimal("2.50"), output_per_mtok=Decimal("10.00")),
            context_window=200_000,
            capabilities=frozenset({"json", "tools", "vision", "long_context"}),
            tiers=("accurate", "balanced", "reasoning"),
            fallbacks=("sim-fast",),
        ),
    )
