"""Leases: calls a process makes itself, on capacity its model's shared actor lent it.

Theory of operation. A call through the cluster crosses three Ray hops (the
ticket to the queue, to its model, the answer back in a long poll): about
4 ms of the 6 ms it added on the 2-core box, whatever batching does. When a
model has capacity to spare, nothing needs deciding across processes: the
queue holds nothing for it, and any process's task may go at once. So the
model's shared actor *lends* an owner permits (``ModelShell.lease``), each a
call admitted there as a ticket's is (a slot of its cap, its breaker's
permit, its limiter's reservation of the permit's tokens), and the owner makes
that call itself, on its own I/O loop, through the model's transport
(``ModelClients.direct``): no hop on the call's way. What the call says is
judged in the owner as every answer is (``attempt.judge``), and learnt on
the shared actor as every call is (``core.learn``), from the owner's
``report`` (batched, off the call's way), so the cluster's one breaker and one
limiter see every call.

Global priority holds because only spare capacity is lent: the model lends
nothing while anything waits for it in the queue (no credit unspent there, or
a ticket held), keeps one slot beside the lent ones for the queue's next
ticket, and a permit is single-use and lives ``PERMIT_S`` in the owner (given
back unused after that). A CRITICAL task in another process therefore waits
at most for a call in flight, as it would for a ticket's.

``Stocks`` keeps each model's permits in this process: a task takes one for
the first of its candidates that has one fitting its size, else goes to the
queue as before and makes the link ask for more (one ask in flight a model;
a refusal rests the asking ``REFUSED_REST_S``). Permits of another
incarnation, of a model whose breaker left closed or that took this process
for dead, are dropped (``drop``). ``Calls`` (held by the assembly, as the
streams' claims are: a restarted link still knows them) maps each task whose
call is in flight on a lease to its permit.

Streams are not called on a lease (their deltas, pauses and cuts live on the
model's actor and in the link's claims).

What must hold: a permit is used for at most one call and never past
``PERMIT_S`` after it came; every permit taken ends in a ``Spent`` or is given
back (``unused``) to the incarnation that lent it, or is void with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeAlias

from callboard.cluster._wire import Lease

PERMIT_S = 0.5
"""How long a lent permit may wait for a call in this process: past it, it goes back
unused (it holds a slot and a limiter reservation another process may want)."""
REFUSED_REST_S = 0.05
"""After a model refused to lend, how long this process sends its tasks to the queue
without asking again (a saturated model is asked no more than this often)."""
WANT_MOST = 4
"""Permits one ask asks for at most."""


@dataclass(frozen=True, slots=True)
class DirectCall:
    """A call this process makes on a permit of ``model``'s actor (``incarnation``)."""

    model: str
    incarnation: int
    permit: int
    attempt: int
    """The job's attempt (calls sent before this one), as a ticket's."""
    sent_at: float
    """When it was started, on the wall clock."""


Calls: TypeAlias = dict[int, DirectCall]
"""Task id -> its call in flight on a lease: held by the assembly, across the link's
incarnations."""


@dataclass(slots=True)
class _Stock:
    incarnation: int = 0
    permits: deque[tuple[int, float]] = field(default_factory=deque)
    """(permit, when it goes back unused on the process's clock), oldest first: taken
    oldest first, each back at its own time (one time for all, renewed by each lease,
    kept the oldest for good under steady traffic: found by a review)."""
    tokens: int = 0
    asking: bool = False
    rest_until: float = 0.0
    """A refusal: not asked again before this."""
    wanted: int = 0
    """Tasks that took a permit, or found none, since the last ask: each wants one."""
    size: int = 0
    """The largest of those tasks (``admission.tokens_of``)."""


@dataclass(frozen=True, slots=True)
class Ask:
    """Ask ``model``'s actor for ``n`` permits of ``tokens``."""

    model: str
    n: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Void:
    """Permits to give back to (or void at) ``model``'s actor of ``incarnation``."""

    model: str
    incarnation: int
    permits: tuple[int, ...]


class Stocks:
    """The permits this process holds, by model (module docstring). Not thread-safe:
    the link's thread alone uses it."""

    def __init__(self, permit_s: float = PERMIT_S) -> None:
        self._by_model: dict[str, _Stock] = {}
        self.permit_s = permit_s
        """How long a permit is held unused before it goes back (``PERMIT_S``)."""

    def take(
        self, candidates: Iterable[str], tokens: int, now: float
    ) -> tuple[str, int, int] | None:
        """A permit for a task of ``tokens`` that may go to ``candidates`` (in order):
        (model, incarnation, permit), or None (it goes to the queue). Either way the
        model it took from, or else its first candidate, is to be asked for one more:
        the next task finds it there."""
        first: _Stock | None = None
        for model in candidates:
            stock = self._by_model.get(model)
            if stock is None:
                stock = self._by_model[model] = _Stock()
            if first is None:
                first = stock
            if tokens <= stock.tokens:
                permit = _oldest_in_time(stock.permits, now)
                if permit is not None:
                    stock.wanted += 1
                    stock.size = max(stock.size, tokens)
                    return model, stock.incarnation, permit
        if first is not None:
            first.wanted += 1
            first.size = max(first.size, tokens)
        return None

    def asks(self, now: float) -> list[Ask]:
        """What to ask for now: for each model tasks wanted permits of (``take``), and
        none is asked already, one for each of those tasks, at most ``WANT_MOST`` held;
        each such model is marked asking."""
        found: list[Ask] = []
        for model, stock in self._by_model.items():
            if stock.wanted and not stock.asking and stock.rest_until <= now:
                n = min(WANT_MOST, stock.wanted + len(stock.permits)) - len(stock.permits)
                tokens = max(stock.size, stock.tokens)
                stock.wanted, stock.size = 0, 0
                if n > 0:
                    stock.asking = True
                    found.append(Ask(model, n, tokens))
        return found

    def got(self, model: str, lease: Lease | None, now: float) -> Void | None:
        """The answer to an ask for ``model``: its permits are held until ``now +
        permit_s``; any held of another incarnation, or a lease for another size,
        go back (the Void returned)."""
        stock = self._by_model.setdefault(model, _Stock())
        stock.asking = False
        if lease is None:
            stock.rest_until = now + REFUSED_REST_S
            return None
        void = None
        if stock.permits and (
            stock.incarnation != lease.incarnation or stock.tokens != lease.tokens
        ):
            void = self.drop(model)
        stock.incarnation, stock.tokens = lease.incarnation, lease.tokens
        until = now + self.permit_s
        stock.permits.extend((p, until) for p in lease.permits)
        return void

    def due(self, model: str, now: float) -> Void | None:
        """``model``'s permits past their time (they go back unused), if any."""
        stock = self._by_model.get(model)
        if stock is None:
            return None
        late: list[int] = []
        while stock.permits and stock.permits[0][1] <= now:
            late.append(stock.permits.popleft()[0])
        return Void(model, stock.incarnation, tuple(late)) if late else None

    def drop(self, model: str) -> Void | None:
        """Every permit held of ``model`` (its actor restarted, took this process for
        dead, or its breaker left closed): to give back, or void."""
        stock = self._by_model.get(model)
        if stock is None or not stock.permits:
            return None
        void = Void(model, stock.incarnation, tuple(p for p, _ in stock.permits))
        stock.permits.clear()
        return void

    def drop_all(self) -> list[Void]:
        """Every permit held (the link stops)."""
        return [v for v in (self.drop(m) for m in list(self._by_model)) if v is not None]

    def held(self) -> int:
        return sum(len(s.permits) for s in self._by_model.values())


def _oldest_in_time(permits: deque[tuple[int, float]], now: float) -> int | None:
    """Take the oldest of ``permits`` not past its time (those past it stay, for
    ``due`` to give back)."""
    for i, (permit, until) in enumerate(permits):
        if until > now:
            del permits[i]
            return permit
    return None
