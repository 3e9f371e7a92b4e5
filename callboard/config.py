"""System configuration: the models, routes, queue and supervision settings.

``SystemConfig()`` with no models means "run on the built-in simulated
provider": ``System()`` then starts one on 127.0.0.1 and configures two
models on it (``sim-fast``, cheap; ``sim-smart``, stronger and dearer), each
the other's fallback, so everything works on a fresh machine with no keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from types import MappingProxyType
from typing import Final

from callboard.core.pricing import MAX_USD, Price
from callboard.core.routing import AUTO, Order
from callboard.core.settings import ModelSettings, SchedulerSettings, check_kinds
from callboard.messages import ConfigError, shown_name, shown_number, shown_value
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
    close_on_refusals: bool | None = None
    """Also count the total as spent once, with nothing reserved, what is left cannot
    pay for the calls it refused since (the work as it comes no longer fits, though a
    smaller call still would): right for a batch of like lines, whose rest a rerun
    sends; wrong for a service, where one large request would close admission for
    every small one after it. None: on for ``callboard run`` and with
    ``stop_when_spent``, off otherwise."""

    def __post_init__(self) -> None:
        tags: object = self.per_tag_usd
        if not isinstance(tags, Mapping) or not all(isinstance(t, str) for t in tags):
            raise ConfigError(
                f"budget.per_tag_usd must be a mapping of tag names to amounts, got "
                f"{shown_value(tags)}"
            )
        if "" in tags:  # said as such: "must be a mapping ... got a dict" (a hunt)
            raise ConfigError("budget.per_tag_usd: a tag name must be a non-empty string")
        object.__setattr__(self, "per_tag_usd", MappingProxyType(dict(tags)))
        limits = [(f"per_tag_usd.{tag}", value) for tag, value in self.per_tag_usd.items()]
        amounts: list[tuple[str, object]] = [("total_usd", self.total_usd), *limits]
        for name, value in amounts:  # the key, as written (a tag said "budget total_usd")
            if value is not None and not _usd(value):
                exact = (  # a str or float is refused for its type, not its size (a hunt)
                    f" ({type(value).__name__}: money is exact, write Decimal({str(value)!r:.40}))"
                    if isinstance(value, str | float)
                    else ""
                )
                raise ConfigError(
                    f"budget.{name} must be a Decimal or int amount from 0 to {MAX_USD}, "
                    f"got {f'{value!r:.40}' if exact else shown_number(value)}{exact}"
                )
        for flag in ("downgrade_when_tight", "stop_when_spent", "close_on_refusals"):
            value = getattr(self, flag)
            if not isinstance(value, bool) and (value is not None or flag != "close_on_refusals"):
                raise ConfigError(  # "false" was taken, and was true (found by a hunt)
                    f"budget.{flag} must be true or false"
                    + (" (or None)" if flag == "close_on_refusals" else "")
                    + f", got {shown_value(value)}"
                )

    @property
    def enabled(self) -> bool:
        return self.total_usd is not None or bool(self.per_tag_usd)


def _route_key(route: str) -> str:
    """A route as its TOML key is written (``routing.routes.fast``), or by its name when
    that would not read as a key (the route was said as ``route 'fast'``, naming no key;
    a hunt)."""
    if route.isidentifier() or route.replace("-", "_").isidentifier():
        return f"routing.routes.{route}"
    return f"route {shown_name(route)}"


def _usd(value: object) -> bool:
    """A finite amount from 0 to ``MAX_USD``. Finiteness is tested before any comparison:
    a NaN compares by raising ``InvalidOperation``, and an infinite (or huge) budget
    overflows the nano-USD arithmetic later. ``True`` is an int to Python, never an
    amount to us."""
    if isinstance(value, bool) or not isinstance(value, Decimal | int):
        return False
    return (not isinstance(value, Decimal) or value.is_finite()) and 0 <= value <= MAX_USD


WHEN_LOST = ("wait", "local")
"""The policies for a cluster lost after the start (``RayCluster.when_lost``)."""


MIN_LEASE_S: Final = 1.0
"""The shortest ``RayCluster.lease_s``: a lease below a poll's wait took live processes
for dead, their waiting tasks dropped and sent again over and over (found by a hunt)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RayCluster:
    """Run the actors that must be one per cluster on Ray (``[cluster] engine = "ray"``):
    one queue and one actor per model, named in ``namespace``, shared by every process
    that points here. Ray is imported only when a system with this starts
    (``pip install 'callboard[ray]'``)."""

    address: str = "auto"
    """What ``ray.init`` connects to: ``"auto"`` (the cluster this machine runs or
    the one Ray already joined in this process), ``"local"`` (start one here),
    ``"ray://host:10001"`` or ``"host:6379"``."""
    namespace: str = "callboard"
    """The Ray namespace the shared actors are named in: systems share a scheduler
    exactly when they share an address and a namespace."""
    lease_s: float = 30.0
    """How long the shared actors keep a process's waiting tasks and answers after it
    last polled them (a client process that died stops holding capacity then)."""
    connect_timeout_s: float = 60.0
    """How long a start may wait for the cluster and its shared actors."""
    lost_after_s: float = 30.0
    """How long the cluster may answer none of this process's polls before it is
    taken for lost (a healthy one answers every quarter of a second)."""
    when_lost: str = "wait"
    """What a lost cluster means for this process's tasks: ``"wait"``, each task waits
    for it up to its deadline and one without a deadline fails ``PROVIDER_DOWN``
    (never a hang); ``"local"``, this process runs its own queue and model actors
    from then on (limits then hold per process) and the tasks the cluster held are
    queued here again."""

    def __post_init__(self) -> None:
        for name in ("address", "namespace"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(
                    f"cluster.{name} must be a non-empty string, got {shown_value(value)}"
                )
        if not isinstance(self.when_lost, str) or self.when_lost not in WHEN_LOST:
            raise ConfigError(
                f"cluster.when_lost must be one of {', '.join(WHEN_LOST)}; got "
                f"{shown_value(self.when_lost)}"
            )
        for name in ("lease_s", "connect_timeout_s", "lost_after_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < math.inf
            ):
                raise ConfigError(
                    f"cluster.{name} must be a number of seconds > 0, got {shown_value(value)}"
                )
        if self.lease_s < MIN_LEASE_S:  # a process polls every quarter of a second
            raise ConfigError(
                f"cluster.lease_s must be at least {MIN_LEASE_S} s (a live process's poll "
                f"waits up to 0.25 s, and the next comes after it), got {self.lease_s!r}"
            )


_PARTS: Final[tuple[tuple[str, type], ...]] = (
    ("scheduler", SchedulerSettings),
    ("supervisor", SupervisorConfig),
    ("budget", BudgetSettings),
)
"""The system's parts, each an object of its own kind."""


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
    cluster: RayCluster | None = None
    """Where the queue and the model actors run: None (the default) in this process on
    pykka; a ``RayCluster``: on Ray, shared with every process pointing at it."""
    order: str = "cost"
    """How candidates are ordered: cost, cheapest, latency, least_busy or config."""
    escalate_to: str | None = None
    """A model appended as the last fallback of every task."""
    seed: int = 0
    """Seeds retry jitter and the simulated provider, for reproducible runs."""
    give_up_s: float = 60.0
    """How long a model may stay down (its breaker not closed) before it is given up
    on, for every model whose breaker sets no ``give_up_s`` of its own (``inf``:
    never): then tasks no other model can take end ``Failed(PROVIDER_DOWN)``."""
    switch_interval_s: float | None = None
    """If set, the interpreter's GIL switch interval while the system runs
    (``sys.setswitchinterval``; restored at stop). It is process-wide, so it is
    off unless asked for; ``callboard run`` asks for ``RUN_SWITCH_INTERVAL_S``.
    Every hop between callboard's threads waits for the GIL, up to the interval
    (5 ms by default) when the I/O loop is busy: at 200 calls in flight a
    shorter one lifted throughput from ~0.86x to ~0.90x of the bare client."""
    steady_heap: bool = False
    """If true, the collector is held steady while the system runs
    (``runtime.collector``: what exists at start frozen, young collections every
    10,000 net allocations instead of 700; put back at stop). Process-wide, so off
    unless asked for; ``callboard run`` and ``callboard serve`` always run so. A batch
    of tasks queued at once is tens of thousands of live objects that each
    collection walks, with every thread stopped: 20,000 tasks at 200 calls in flight
    spent 1.8 s of an 8 s run in collections (the longest 240 ms) against 0.23 s
    held steady."""

    def __post_init__(self) -> None:
        self._check_parts()
        if self.cluster is not None:
            if not isinstance(self.cluster, RayCluster):
                raise ConfigError(f"cluster must be a RayCluster or None, got {self.cluster!r}")
            if not self.models:  # each process's simulator has an address of its own
                raise ConfigError(
                    "a cluster needs configured models (the built-in simulated provider "
                    "is one per process): point [models.NAME] at one provider"
                )
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
        if not isinstance(self.steady_heap, bool):
            raise ConfigError(f"steady_heap must be true or false, got {self.steady_heap!r}")
        g = self.give_up_s
        if isinstance(g, bool) or not isinstance(g, int | float) or not g > 0:
            raise ConfigError(f"give_up_s must be a number of seconds > 0 (inf: never), got {g!r}")
        object.__setattr__(self, "models", tuple(_giving_up(m, g) for m in self.models))
        given: object = self.routes
        if not isinstance(given, Mapping) or not all(isinstance(n, str) and n for n in given):
            raise ConfigError(
                f"routes must be a mapping of route names to lists of models, got "
                f"{shown_value(given)}"
            )
        routes = {name: _route(members, f"route {name!r}") for name, members in given.items()}
        object.__setattr__(self, "routes", MappingProxyType(routes))
        d: object = self.default_route
        if d is not None:  # one name may come bare, as in TOML: it cannot be mistaken
            object.__setattr__(
                self, "default_route", _route((d,) if isinstance(d, str) else d, "default_route")
            )
        try:
            Order(self.order)
        except (TypeError, ValueError):
            allowed = ", ".join(o.value for o in Order)
            raise ConfigError(
                f"order must be one of {allowed}; got {shown_value(self.order)}"
            ) from None
        e: object = self.escalate_to
        if e is not None and (not isinstance(e, str) or not e):
            raise ConfigError(f"escalate_to must be a model's name or None, got {shown_value(e)}")
        self._check_names()

    def _check_parts(self) -> None:
        """Each part an object of its kind (a ``dict``, a TOML table's shape, failed at
        start, untyped)."""
        models: object = self.models
        if not isinstance(models, list | tuple):
            raise ConfigError(
                f"models must be a list or tuple of ModelSettings, got {type(models).__name__}"
            )
        for i, m in enumerate(models):
            if not isinstance(m, ModelSettings):
                raise ConfigError(f"models[{i}] must be a ModelSettings, got {type(m).__name__}")
        check_kinds(self, _PARTS)
        if type(self.seed) is not int:
            raise ConfigError(f"seed must be an integer, got {self.seed!r:.60}")

    def _check_names(self) -> None:
        """Every name the config uses names a configured model (or, for the default
        route, a route); with no models (the simulator) only the models' own fallbacks
        can be checked, since the simulated models are made at start."""
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"model names must be unique; repeated: {dupes}")
        known = set(names)
        # "auto" is the classifier's: refused at start, not here, before (found by a hunt)
        if AUTO in self.routes:
            raise ConfigError(f"{_route_key(AUTO)}: {AUTO!r} is reserved for the classifier")
        for m in self.models:
            if AUTO in m.tiers:
                raise ConfigError(
                    f"model {shown_name(m.name)}: the tier {AUTO!r} is reserved for the classifier"
                )
        for m in self.models:
            for fb in m.fallbacks:
                if fb not in known:
                    raise ConfigError(
                        f"model {shown_name(m.name)}: fallback {shown_name(fb)} is not a "
                        "configured model"
                    )
        if not self.models:
            return
        for key, members in [
            *((_route_key(name), route) for name, route in self.routes.items()),
            ("routing.default", self._default_models()),
        ]:
            for member in members:
                if member not in known:
                    raise ConfigError(f"{key} names unknown model {shown_name(member)}")
        if self.escalate_to is not None and self.escalate_to not in known:
            raise ConfigError(f"escalate_to names unknown model {shown_name(self.escalate_to)}")

    def _default_models(self) -> tuple[str, ...]:
        """The default route when it names models; () when it is one route name (a tier,
        a route or "auto"), the way ``System`` reads it: one name that is no model is a
        route name."""
        d = self.default_route or ()
        known = {m.name for m in self.models}
        if len(d) == 1 and d[0] not in known:
            if d[0] == AUTO or d[0] in self.routes or self._is_tier(d[0]):
                return ()
            tiers = {t for m in self.models for t in m.tiers}
            routes = ", ".join([*sorted({*self.routes, *tiers}), AUTO])
            raise ConfigError(
                f"default_route (a file's routing.default) {shown_name(d[0])} is neither a "
                "configured model nor a route "
                f"(routes: {routes})"
            )
        return d

    def _is_tier(self, name: str) -> bool:
        return any(name in m.tiers for m in self.models)

    @property
    def simulated(self) -> bool:
        return not self.models


def _route(members: object, what: str) -> tuple[str, ...]:
    """A route's models as a non-empty tuple of names. An empty route would turn every
    plan into a misleading "no model has every required capability []"; a bare string
    would be split into letters."""
    if isinstance(members, str) or not isinstance(members, list | tuple):
        raise ConfigError(f"{what} must be a list of model names, got {members!r}")
    if not members:
        raise ConfigError(f"{what} lists no model")
    if not all(isinstance(m, str) and m for m in members):
        raise ConfigError(f"{what} must be a list of non-empty names, got {members!r}")
    return tuple(members)


def simulated_models(base_url: str) -> tuple[ModelSettings, ...]:
    """The two default models on the simulated provider."""
    return (
        ModelSettings(
            name="sim-fast",
            base_url=base_url,
            max_concurrency=64,
            price=Price(input_per_mtok=Decimal("0.15"), output_per_mtok=Decimal("0.60")),
            context_window=128_000,
            capabilities=frozenset({"json", "tools", "embeddings"}),
            tiers=("fast", "cheap"),
            fallbacks=("sim-smart",),
        ),
        ModelSettings(
            name="sim-smart",
            base_url=base_url,
            max_concurrency=32,
            price=Price(input_per_mtok=Decimal("2.50"), output_per_mtok=Decimal("10.00")),
            context_window=200_000,
            capabilities=frozenset({"json", "tools", "vision", "embeddings", "long_context"}),
            tiers=("accurate", "balanced", "reasoning"),
            fallbacks=("sim-fast",),
        ),
    )


def _giving_up(model: ModelSettings, give_up_s: float) -> ModelSettings:
    """``model`` with the system's ``give_up_s`` where its breaker sets none."""
    if model.breaker.give_up_s is not None:
        return model
    return replace(model, breaker=replace(model.breaker, give_up_s=give_up_s))
