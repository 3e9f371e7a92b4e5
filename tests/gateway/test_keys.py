"""Who is calling: keys checked by digest, and what a key may ask for."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from callboard.gateway import Caller, ClientKey, KeyRing
from callboard.gateway.keys import ANONYMOUS, TwoKeysError, presented_key
from callboard.messages import Priority
from multidict import CIMultiDict


def key(name: str, secret: str, **fields: Any) -> ClientKey:
    digest = hashlib.sha256(secret.encode()).digest()
    return ClientKey(name=name, digest=digest, tenant=f"tenant-{name}", **fields)


RING = KeyRing([key("a", "sk-a"), key("b", "sk-b", max_priority=Priority.HIGH)])


def test_a_configured_key_names_its_caller() -> None:
    caller = RING.caller("sk-b")
    assert caller is not None
    assert (caller.name, caller.tenant, caller.max_priority) == ("b", "tenant-b", Priority.HIGH)


@pytest.mark.parametrize("presented", [None, "", "sk-c", "sk-a ", "SK-A", "sk-\udcff"])
def test_any_other_key_is_nobody(presented: str | None) -> None:
    assert RING.caller(presented) is None


def test_an_open_ring_lets_everyone_in_anonymously() -> None:
    open_ring = KeyRing([])
    assert open_ring.open
    assert open_ring.caller(None) is ANONYMOUS
    assert open_ring.caller("anything") is ANONYMOUS
    assert ANONYMOUS.tenant is None
    assert ANONYMOUS.may_use("any-model")


def test_the_ring_shows_no_digest() -> None:
    assert repr(RING) == "<KeyRing 2 keys>"
    assert hashlib.sha256(b"sk-a").hexdigest() not in repr(key("a", "sk-a"))


@pytest.mark.parametrize(
    ("headers", "found"),
    [
        ({"Authorization": "Bearer sk-1"}, "sk-1"),
        ({"authorization": "bearer   sk-1  "}, "sk-1"),
        ({"Authorization": "Basic c2stMQ=="}, None),
        ({"Authorization": "Bearer "}, None),
        ({"x-api-key": "sk-2"}, "sk-2"),  # Anthropic's SDK
        ({"api-key": "sk-3"}, "sk-3"),  # Azure's
        ({"Authorization": "Bearer sk-1", "x-api-key": "sk-1"}, "sk-1"),  # one key, twice
        ({}, None),
        # a proxy's own credential in front (nginx auth_basic) presents no key: it hid
        # the SDK's x-api-key, and every request was refused (found by a hunt)
        ({"Authorization": "Basic dXNlcjpwYXNz", "x-api-key": "sk-2"}, "sk-2"),
        ({"Authorization": "Basic dXNlcjpwYXNz", "api-key": "sk-3"}, "sk-3"),
        ({"Authorization": "Bearer ", "x-api-key": "sk-2"}, "sk-2"),
    ],
)
def test_the_key_is_read_from_the_header_each_sdk_sends(
    headers: dict[str, str], found: str | None
) -> None:
    assert presented_key(CIMultiDict(headers)) == found


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer sk-1", "x-api-key": "sk-2"},
        {"Authorization": "Bearer sk-1", "api-key": "garbage"},
        {"x-api-key": "sk-2", "api-key": "sk-1"},
    ],
)
def test_two_different_keys_are_refused_not_one_of_them_taken(headers: dict[str, str]) -> None:
    """The bearer token (or x-api-key) won: a good key beside a wrong one passed, and the
    first decided whose budget paid (found by a hunt)."""
    with pytest.raises(TwoKeysError, match="two different keys"):
        presented_key(CIMultiDict(headers))


@pytest.mark.parametrize(
    ("asked", "got"),
    [
        (None, Priority.LOW),  # the key's default
        (Priority.NORMAL, Priority.NORMAL),
        (Priority.HIGH, Priority.HIGH),
        (Priority.CRITICAL, Priority.HIGH),  # capped at the ceiling
    ],
)
def test_a_priority_is_capped_by_the_keys_ceiling(asked: Priority | None, got: Priority) -> None:
    caller = Caller(name="a", tenant="t", priority=Priority.LOW, max_priority=Priority.HIGH)
    assert caller.priority_for(asked) is got


def test_a_key_may_use_only_its_models() -> None:
    caller = Caller.of(key("a", "sk-a", models=frozenset({"fast"})))
    assert caller.may_use("fast")
    assert not caller.may_use("sim-smart")
