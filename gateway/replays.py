"""Idempotency-Keys remembered: a retried request gets the first one's answer.

A client that sends ``Idempotency-Key`` and loses its connection sends the same
request again with the same key. callboard's ledger refuses a second task with
a key it knows (``Rejected(DUPLICATE)``); the gateway instead answers the retry
with the first request's result, waiting for it if it is still on its way (as
Stripe's API and the IETF ``Idempotency-Key`` draft do). A key reused with
another body is refused (422), and a key the table no longer holds answers 409.

Keys are the tenant's: ``scoped`` puts the tenant in front, so one tenant's key
never finds another's answer. The table is shared, and what it forgets is the oldest
entry of the tenant holding the most (entries past ``capacity``, bytes past
``max_bytes``): one oldest-first table let a tenant's burst of requests push every
other tenant's answers out, and their retries got 409 and had to pay for the call
again (found by a hunt). A tenant alone still has the whole table.

A first request that ended without a call made (its deadline passed in the queue, a
policy refused it, callboard stopped), or cancelled (its client left mid-stream), is
no answer to keep: its entry goes once its result comes (a retry waiting for it
meanwhile gets that result), and the next request with the key is a new first one, as
the ledger lets it be (``ledger.binds_key``).

Requests with one key at once: the first is *taken* (``first`` answers None) until
its task is submitted and its entry added, or it fails before that; the others wait
in ``first`` and then get its entry (or, if it failed, the next of them is taken).
Looked up and added apart, two requests waiting for their quota at once both went
on: the second was refused by the ledger, and its refusal replaced the first's
answer for every later retry.

What must hold: at most ``capacity`` entries, and answers of at most ``max_bytes``
(as ``answer_bytes`` counts them, once each resolves; a forgotten key's retry gets
409, never a second call); an entry is added only once its
task was submitted; at most one request a key is taken at a time; everything here
runs on the gateway's event loop (no lock).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from callboard.messages import Result
from callboard.runtime.ledger import binds_key
from callboard.wire.openai import reasoning_of

__all__ = ["Replay", "Replays", "answer_bytes", "scoped"]

_SCOPE = "gateway:"
"""What every key ``scoped`` makes starts with, before its tenant's length and name."""


@dataclass(frozen=True, slots=True)
class Replay:
    """The first request of a key: its body's digest and its task's future."""

    body_sha256: bytes
    result: asyncio.Future[Result]
    """Resolves to the first request's result (await it shielded: a replay that
    leaves must not cancel it)."""


class Replays:
    """A bounded table of ``Idempotency-Key`` -> the first request's ``Replay``."""

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.held_bytes = 0
        """What the answers kept take, as ``answer_bytes`` counts them."""
        self._sizes: dict[str, int] = {}
        self._entries: dict[str, Replay] = {}
        self._tenants: dict[str, _Held] = {}
        """What each tenant (``_tenant_of`` its keys) holds, its keys oldest first."""
        self._most_entries: list[tuple[int, str]] = []
        self._most_bytes: list[tuple[int, str]] = []
        """``(-count, tenant)`` and ``(-bytes, tenant)`` as each last changed: heaps whose
        first record still true names the tenant holding the most (``_most``). A scan of
        every tenant at each add cost 110 us with 1,000 tenants (a review)."""
        self._taken: dict[str, asyncio.Event] = {}
        """Keys whose first request is on its way to a task, set when it has one."""

    def get(self, key: str) -> Replay | None:
        return self._entries.get(key)

    async def first(self, key: str) -> Replay | None:
        """``key``'s entry, once no other request with it is being taken; None: this
        request is taken as the key's first (``let_go(key)`` once it is added or has
        failed)."""
        while True:
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            taken = self._taken.get(key)
            if taken is None:
                self._taken[key] = asyncio.Event()
                return None
            await taken.wait()

    def let_go(self, key: str) -> None:
        """The request taken for ``key`` has its entry, or never will: the others go
        on (idempotent)."""
        taken = self._taken.pop(key, None)
        if taken is not None:
            taken.set()

    def add(self, key: str, body: bytes, result: asyncio.Future[Result]) -> None:
        """Remember ``result`` as the answer to ``key`` (``body``: the request's bytes)."""
        self.let_go(key)
        if self.capacity == 0:
            return
        while len(self._entries) >= self.capacity:
            self._forget(self._most(self._most_entries, len))
        entry = self._entries[key] = Replay(digest(body), result)
        tenant = _tenant_of(key)
        held = self._tenants.get(tenant)
        if held is None:
            held = self._tenants[tenant] = _Held(tenant)
        held.keys[key] = None
        self._changed(held)
        result.add_done_callback(lambda done: self._sized(key, entry, done))

    def _sized(self, key: str, entry: Replay, done: asyncio.Future[Result]) -> None:
        """``key``'s answer came: count its room, and forget the oldest past the bound."""
        if self._entries.get(key) is not entry or done.cancelled() or done.exception():
            return
        result = done.result()
        if not binds_key(result):  # expired in the queue, refused, stopped, cancelled:
            self._drop(key)  # the key is free, in the ledger too, and a retry is a new
            return  # request; the same 504 (or 409) answered every one (found by a hunt)
        size = self._sizes[key] = answer_bytes(result)
        self.held_bytes += size
        held = self._tenants[_tenant_of(key)]
        held.bytes += size
        self._changed(held)
        while self.max_bytes is not None and self.held_bytes > self.max_bytes and self._entries:
            self._forget(self._most(self._most_bytes, _bytes_of))

    def _forget(self, held: _Held) -> None:
        """Forget the oldest entry of ``held``'s tenant."""
        self._drop(next(iter(held.keys)))

    def _drop(self, key: str) -> None:
        del self._entries[key]
        size = self._sizes.pop(key, 0)
        self.held_bytes -= size
        held = self._tenants[_tenant_of(key)]
        del held.keys[key]
        held.bytes -= size
        if held.keys:
            self._changed(held)
        else:
            del self._tenants[held.tenant]

    def _changed(self, held: _Held) -> None:
        """Record ``held``'s new count and bytes (the records before go stale)."""
        heapq.heappush(self._most_entries, (-len(held), held.tenant))
        heapq.heappush(self._most_bytes, (-held.bytes, held.tenant))
        if len(self._most_entries) > 2 * len(self._tenants) + _SLACK:
            self._most_entries = [(-len(h), t) for t, h in self._tenants.items()]
            self._most_bytes = [(-h.bytes, t) for t, h in self._tenants.items()]
            heapq.heapify(self._most_entries)
            heapq.heapify(self._most_bytes)

    def _most(self, records: list[tuple[int, str]], size: Callable[[_Held], int]) -> _Held:
        """The tenant holding the most, by ``size``: the first record still true."""
        while True:
            negative, tenant = records[0]
            held = self._tenants.get(tenant)
            if held is not None and -negative == size(held):
                return held
            heapq.heappop(records)  # stale: the tenant's count changed, or it is gone

    def __len__(self) -> int:
        return len(self._entries)


class _Held:
    """One tenant's entries: its keys, oldest first, and their answers' bytes."""

    __slots__ = ("bytes", "keys", "tenant")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.keys: OrderedDict[str, None] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.keys)


def _bytes_of(held: _Held) -> int:
    return held.bytes


_SLACK = 64
"""Stale records the heaps may hold beyond two a tenant before they are rebuilt."""


def _tenant_of(key: str) -> str:
    """The tenant ``scoped`` put in front of ``key`` ("" for a key it did not make)."""
    if not key.startswith(_SCOPE):
        return ""
    length, _, rest = key[len(_SCOPE) :].partition(":")
    return rest[: int(length)] if length.isdigit() else ""


ENTRY_BYTES = 5 * 1024
"""What an entry takes besides its texts and logprobs: its result, the provider's body
kept to replay as received, its future, key and digest. 57 MB for 10,000 short answers
(some 5.7 KB each, their texts a few hundred bytes) where 1 KB was counted, so
``idempotency_mb`` held about five times its room (found by a hunt)."""

LOGPROB_BYTES = 450
"""What one token's logprob takes once parsed (a dict of its token, logprob and bytes;
each of its ``top_logprobs`` as much again): 404-443 bytes measured by tracemalloc,
its JSON 4.3-4.8 times over."""


def answer_bytes(result: Result) -> int:
    """About what a kept answer takes: its texts twice (as read, and in the provider's
    body kept beside them to replay as received), its logprobs (the provider's body
    and the result hold the same ones), and a little for the rest. Counted by their
    texts alone, answers with logprobs took some 600 times what was counted: 1 MB of
    room held 160 MB (found by a hunt)."""
    texts = [
        getattr(result, "content", ""),
        getattr(result, "refusal", None) or "",
        *(choice.content for choice in getattr(result, "choices", ())),
        *(call.arguments for call in getattr(result, "tool_calls", ())),
        *_reasonings(getattr(result, "raw", None)),
    ]
    logprobs = {
        id(lp): lp
        for lp in (
            getattr(result, "logprobs", None),
            *(choice.logprobs for choice in getattr(result, "choices", ())),
        )
        if lp
    }
    tokens = sum(_logprob_entries(lp) for lp in logprobs.values())
    texts_bytes = 2 * sum(len(t) for t in texts if isinstance(t, str))
    return ENTRY_BYTES + texts_bytes + LOGPROB_BYTES * tokens


def _reasonings(raw: Any) -> list[Any]:
    """The reasoning each choice of the provider's body holds (kept in it alone)."""
    choices = raw.get("choices") if isinstance(raw, Mapping) else None
    if not isinstance(choices, list):
        return []
    messages = (c.get("message") for c in choices if isinstance(c, Mapping))
    return [reasoning_of(m) for m in messages if isinstance(m, Mapping)]


def _logprob_entries(logprobs: Any) -> int:
    """How many tokens' logprobs ``logprobs`` holds, each of their alternatives too."""
    if not isinstance(logprobs, Mapping):
        return 0
    count = 0
    for part in ("content", "refusal"):
        entries = logprobs.get(part)
        if isinstance(entries, list):
            count += len(entries)
            for entry in entries:
                top = entry.get("top_logprobs") if isinstance(entry, dict) else None
                if isinstance(top, list):
                    count += len(top)
    return count


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def scoped(tenant: str | None, key: str, models: frozenset[str] | None = None) -> str:
    """The ledger's idempotency key for a tenant's ``Idempotency-Key``, sent by a key
    that only ``models`` may serve (None: any): two keys of one tenant that may be
    served by different models do not share answers (a replay would hand one a
    model's answer it may not have)."""
    tenant = tenant or ""
    scope = f"{_SCOPE}{len(tenant)}:{tenant}:"  # the length: no tenant ends in another's key
    if models is not None:
        names = "\n".join(sorted(models)).encode()
        scope += f"models={hashlib.sha256(names).hexdigest()[:16]}:"
    return scope + key
