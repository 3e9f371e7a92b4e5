"""A submit's arguments (callboard/_submitter.py), read once for every face: a misspelt
or unknown keyword, a burst that is not a collection, a ``wait_s`` or ``trace_id`` of
the wrong kind, and metadata that is not plain JSON each raise ``InvalidRequestError``
(a ``UsageError``) naming the argument and what is allowed, before anything is sent,
whether they come through ``System``, ``AsyncSystem`` or a pattern; the prompt may be
given as ``prompt=`` or ``messages=``, as a JSONL line gives it. The faces' timeouts
(``drain``, ``stop``, a pattern's) and ``cancel``'s ids are read the same way: a stop
given a timeout it cannot wait stops nothing.

Every test runs a real ``System`` over a loopback server answering as OpenAI does.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from loopback import WireServer, answer
from support import WAIT_S

from callboard import (
    AsyncSystem,
    InvalidRequestError,
    ModelSettings,
    Request,
    System,
    SystemConfig,
    UsageError,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]

Call = Callable[[System], object]


def _async(call: Callable[[AsyncSystem], Any]) -> Call:
    """``call`` through an ``AsyncSystem`` fronting the test's system, on a fresh loop."""

    def run(system: System) -> object:
        cb = AsyncSystem()
        cb._system = system  # the face over the test's system
        return asyncio.run(call(cb))

    return run


FACES: dict[str, Callable[[dict[str, Any]], Call]] = {
    "submit": lambda kw: lambda s: s.submit("hi", **kw),
    "submit_many": lambda kw: lambda s: s.submit_many(["a", "b"], **kw),
    "async submit": lambda kw: _async(lambda cb: cb.submit("hi", **kw)),
    "async submit_many": lambda kw: _async(lambda cb: cb.submit_many(["a"], **kw)),
    "gather": lambda kw: lambda s: s.gather(["a", "b"], **kw),
    "race": lambda kw: lambda s: s.race("hi", ["alpha", "beta"], **kw),
    "chain": lambda kw: lambda s: s.chain(["say {input}"], "hi", **kw),
}


@pytest.fixture
def server() -> Iterator[WireServer]:
    with WireServer(answer()) as server:
        yield server


@pytest.fixture
def system(server: WireServer) -> Iterator[System]:
    models = tuple(ModelSettings(name=n, base_url=server.base_url) for n in ("alpha", "beta"))
    system = System(SystemConfig(models=models))
    yield system
    system.stop(cancel=True, timeout=WAIT_S)


def _refused(system: System, server: WireServer, call: Call) -> str:
    """Run a misuse: its error, once nothing was accepted or sent."""
    with pytest.raises(InvalidRequestError) as caught:
        call(system)
    assert isinstance(caught.value, UsageError)
    assert system.ledger.counts().accepted == 0
    assert server.count() == 0
    return str(caught.value)


@pytest.mark.parametrize("face", FACES)
def test_a_misspelt_keyword_names_itself_and_its_close_match(
    system: System, server: WireServer, face: str
) -> None:
    error = _refused(system, server, FACES[face]({"priorty": "high"}))
    assert "unknown keyword 'priorty' (did you mean 'priority'?)" in error
    assert "budget_tag" in error  # and what is allowed


@pytest.mark.parametrize("face", ["submit", "submit_many", "async submit", "race"])
def test_an_unknown_keyword_lists_what_is_allowed(
    system: System, server: WireServer, face: str
) -> None:
    error = _refused(system, server, FACES[face]({"colour": "red"}))
    assert "unknown keyword 'colour'; it takes" in error
    assert "deadline_s" in error


@pytest.mark.parametrize("prompts", [None, 5, "one prompt", b"bytes", {"a": 1}, Request.of("x")])
@pytest.mark.parametrize("face", ["submit_many", "async submit_many", "gather"])
def test_a_burst_must_be_a_collection_of_prompts(
    system: System, server: WireServer, face: str, prompts: object
) -> None:
    calls: dict[str, Call] = {
        "submit_many": lambda s: s.submit_many(prompts),  # type: ignore[arg-type]
        "async submit_many": _async(lambda cb: cb.submit_many(prompts)),
        "gather": lambda s: s.gather(prompts),  # type: ignore[arg-type]
    }
    error = _refused(system, server, calls[face])
    assert "takes a list of prompts (strings, message lists or Requests)" in error
    assert f"got {type(prompts).__name__}; for one prompt use submit" in error


@pytest.mark.parametrize("wait_s", ["1", float("nan"), float("inf"), 1e300, -1, True])
@pytest.mark.parametrize("face", ["submit", "submit_many", "async submit"])
def test_wait_s_is_none_or_a_number_of_seconds_the_platform_can_wait(
    system: System, server: WireServer, face: str, wait_s: object
) -> None:
    error = _refused(system, server, FACES[face]({"wait_s": wait_s}))
    assert error.startswith("wait_s must be None or a number of seconds from 0 to ")
    assert repr(wait_s) in error


@pytest.mark.parametrize(
    "trace_id",
    # a newline or a terminal's escape forged lines in callboard's log (found by a hunt)
    [5, "", "  ", b"t", "t\nINFO callboard: forged", "t\x1b[2K", "t\u2028x", "t\ud800"],
)
@pytest.mark.parametrize("face", ["submit", "submit_many", "race", "chain"])
def test_trace_id_is_none_or_a_non_empty_string_that_a_log_line_can_hold(
    system: System, server: WireServer, face: str, trace_id: object
) -> None:
    error = _refused(system, server, FACES[face]({"trace_id": trace_id}))
    assert error == (
        "trace_id must be None or a non-empty string without control characters or line "
        f"separators (it is logged), got {trace_id!r}"
    )


def test_the_prompt_may_be_given_as_a_jsonl_line_gives_it(system: System) -> None:
    by_messages = system.submit(messages=CHAT, model="alpha").result(WAIT_S)
    by_prompt = system.submit(prompt="hi", model="alpha").result(WAIT_S)
    awaited = asyncio.run(_async_submit(system, messages=CHAT, model="alpha"))
    assert by_messages.ok
    assert by_prompt.ok
    assert awaited.ok


async def _async_submit(system: System, **fields: Any) -> Any:
    cb = AsyncSystem()
    cb._system = system  # the face over the test's system
    return await cb.submit(**fields)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.submit(),
        lambda s: s.submit("hi", messages=CHAT),
        lambda s: s.submit("hi", prompt="hi"),
        lambda s: s.submit(prompt="hi", messages=CHAT),
    ],
    ids=["none", "argument and messages", "argument and prompt", "prompt and messages"],
)
def test_a_submit_gives_exactly_one_prompt(system: System, server: WireServer, call: Call) -> None:
    assert "give one prompt" in _refused(system, server, call)


NOT_JSON = {
    "object": ({"who": object()}, "metadata['who'] is of type object"),
    "datetime": (
        {"at": {"when": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)}},
        "metadata['at']['when'] is of type datetime",
    ),
    "set": ({"tags": {"a"}}, "metadata['tags'] is of type set"),
    "tuple": ({"pair": (1, 2)}, "metadata['pair'] is of type tuple"),
    "key": ({"by_id": {7: "x"}}, "metadata['by_id'] has a key that is not a string: 7"),
    "int subclass key": ({"by_id": {True: "x"}}, "metadata['by_id'] has a key that is not a"),
}


def _deep(levels: int) -> dict[str, Any]:
    nested: list[Any] = []
    for _ in range(levels):
        nested = [nested]
    return {"d": nested}


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        *NOT_JSON.values(),
        (_deep(200), "nests deeper than 100 levels"),
    ],
    ids=[*NOT_JSON, "deep"],
)
def test_metadata_that_is_not_plain_json_is_refused_naming_where(
    system: System, server: WireServer, metadata: dict[str, Any], problem: str
) -> None:
    error = _refused(system, server, lambda s: s.submit("hi", metadata=metadata))
    assert error.startswith("metadata cannot be stored as JSON: ")
    assert problem in error


def test_a_request_built_by_hand_refuses_metadata_that_is_not_json() -> None:
    with pytest.raises(InvalidRequestError, match=r"metadata\['at'\] is of type date"):
        Request.of("hi", metadata={"at": datetime.date(2026, 1, 1)})


def test_plain_json_metadata_comes_back_as_it_went(system: System) -> None:
    metadata = {"user": "ada", "n": 3, "ok": True, "none": None, "x": 0.5, "deep": [{"k": []}]}
    result = system.submit("hi", model="alpha", metadata=metadata).result(WAIT_S)
    assert result.ok
    assert dict(result.metadata) == metadata


TIMED: dict[str, Callable[[Any], Call]] = {
    "drain": lambda t: lambda s: s.drain(t),
    "stop": lambda t: lambda s: s.stop(timeout=t),
    "gather": lambda t: lambda s: s.gather(["a"], timeout=t),
    "race": lambda t: lambda s: s.race("hi", ["alpha", "beta"], timeout=t),
    "async drain": lambda t: _async(lambda cb: cb.drain(t)),
    "async stop": lambda t: _async(lambda cb: cb.stop(timeout=t)),
    "async gather": lambda t: _async(lambda cb: cb.gather(["a"], timeout=t)),
}


@pytest.mark.parametrize("timeout", ["1", float("nan"), -1.0, 1e300])
@pytest.mark.parametrize("face", TIMED)
def test_a_timeout_is_none_or_a_number_of_seconds_and_a_bad_one_stops_nothing(
    system: System, server: WireServer, face: str, timeout: object
) -> None:
    error = _refused(system, server, TIMED[face](timeout))
    assert error == (
        f"timeout must be None or a number of seconds from 0 to {threading.TIMEOUT_MAX:.0f}, "
        f"got {timeout!r}"
    )
    assert system.submit("still running", model="alpha").result(WAIT_S).ok


@pytest.mark.parametrize("ids", [("a",), (None,), (True,), (1.0,)])
def test_cancel_takes_task_ids(system: System, server: WireServer, ids: tuple[Any, ...]) -> None:
    error = _refused(system, server, lambda s: s.cancel(*ids))
    assert error == f"cancel takes task ids (integers), got {ids!r}"
