"""Who is calling: a client key checked against the configured digests, and what
that key may ask for (priority ceiling, models).

Theory of operation: a request presents its key as ``Authorization: Bearer <key>``
(the OpenAI SDK) or ``x-api-key`` / ``api-key`` (Anthropic's and Azure's); the
key is hashed with SHA-256 and the digest compared with every configured one
by ``hmac.compare_digest``, all of them every time, so neither the time taken
nor an early exit says how close a guess was or which key matched. Only the
key's name (its label in the config) is ever shown.

An open gateway (no keys) has one anonymous ``Caller`` with no tenant, no
ceiling and every model.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from callboard.gateway.settings import ClientKey
from callboard.messages import Priority

__all__ = ["ANONYMOUS", "Caller", "KeyRing", "TwoKeysError", "presented_key"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """The authenticated client of one request."""

    name: str
    """The key's label (``anonymous`` on an open gateway)."""
    tenant: str | None
    """Its budget tag (None on an open gateway)."""
    priority: Priority = Priority.NORMAL
    max_priority: Priority = Priority.CRITICAL
    models: frozenset[str] | None = None
    """The model and route names it may use (None: every one)."""
    operator: bool = False
    """Whether it reads every tenant's and key's figures in the stats."""

    def priority_for(self, asked: Priority | None) -> Priority:
        """The priority a request gets: what it asked (or the key's default), never
        more urgent than the key's ceiling."""
        wanted = self.priority if asked is None else asked
        return max(wanted, self.max_priority)  # lower is more urgent

    def may_use(self, name: str) -> bool:
        return self.models is None or name in self.models

    @classmethod
    def of(cls, key: ClientKey) -> Caller:
        return cls(
            name=key.name,
            tenant=key.tenant,
            priority=key.priority,
            max_priority=key.max_priority,
            models=key.models,
            operator=key.operator,
        )


ANONYMOUS = Caller(name="anonymous", tenant=None, operator=True)
"""The caller of an open gateway."""


class KeyRing:
    """The configured keys; ``caller(key)`` says whose a presented key is."""

    def __init__(self, keys: Sequence[ClientKey]) -> None:
        self._keys = tuple((k.digest, Caller.of(k)) for k in keys)

    @property
    def open(self) -> bool:
        return not self._keys

    def caller(self, presented: str | None) -> Caller | None:
        """The caller whose key was ``presented`` (``ANONYMOUS`` on an open ring), or
        None: no key, or not one of ours."""
        if not self._keys:
            return ANONYMOUS
        if not presented:
            return None
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found = None
        for known, caller in self._keys:  # every one, whatever matched
            if hmac.compare_digest(known, digest):
                found = caller
        return found

    def __repr__(self) -> str:
        return f"<KeyRing {len(self._keys)} keys>"


class TwoKeysError(ValueError):
    """A request presented two different keys: which one is meant is not ours to guess."""


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>``, ``x-api-key`` or
    ``api-key``; None when there is none. ``Authorization`` of another scheme (``Basic``,
    from an nginx ``auth_basic`` or a single sign-on proxy in front) or an empty bearer
    token presents no key: it hid the ``x-api-key`` beside it, and every request of an
    Anthropic SDK behind such a proxy was refused (found by a hunt). ``TwoKeysError``
    when they disagree: the bearer token won, so a good key beside a wrong one (or
    another tenant's) passed, and the first key decided who paid (found by a hunt). The
    same key in two of them is that key. (``headers`` looks names up in any case.)"""
    auth = headers.get("Authorization")
    bearer: str | None = None
    if auth is not None:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer":
            bearer = token.strip() or None
    found = {k for k in (bearer, headers.get("x-api-key"), headers.get("api-key")) if k}
    if len(found) > 1:
        raise TwoKeysError("two different keys (Authorization, x-api-key, api-key): send one")
    return next(iter(found), None)
