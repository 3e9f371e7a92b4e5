"""Messages and results are frozen data with readable reprs; requests check themselves
and name the bad field; money is exact; secrets never show."""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import math
import pickle
from concurrent.futures import Future
from decimal import Decimal
from types import MappingProxyType
from typing import Any

import pytest
from callboard.core.settings import ModelSettings, Secret
from callboard.messages import (
    AdmitDue,
    Billed,
    BreakerState,
    Call,
    CallResult,
    CallsDone,
    CallShape,
    Cancel,
    Cancelled,
    ChatMessage,
    CheckLiveness,
    ChildFailed,
    ChildStopped,
    Choice,
    Completed,
    Crash,
    EmbeddingResult,
    Enqueue,
    EscalateDue,
    Expired,
    ExpireDue,
    Failed,
    FailureReason,
    Finished,
    GetState,
    GetStats,
    GroupStats,
    Health,
    InvalidRequestError,
    Job,
    LetGo,
    Percentiles,
    Priority,
    Ready,
    Redelivered,
    Regrant,
    Rejected,
    RejectReason,
    ReplaceChildren,
    Request,
    RestartChild,
    Result,
    Route,
    StartChildren,
    Stats,
    StatsOverdue,
    StopChildren,
    StreamDelta,
    Task,
    TaskFuture,
    ToolCall,
    ToolCallDelta,
    TracePrefix,
    Usage,
    UsageError,
    credential_like,
)

import callboard
from callboard import ClusterUnreachableError, messages

REQUEST = Request.of("hello")
TASK = Task(task_id=1, trace_id="t1", request=REQUEST, submitted_at=0.0, future=Future())
JOB = Job(task=TASK, candidates=("alpha",))
DONE = Completed(task_id=1, trace_id="t1", content="hi")

SAMPLES: list[Any] = [
    ChatMessage(role="user", content="hi"),
    REQUEST,
    Usage(prompt_tokens=1, completion_tokens=2),
    Billed(model="alpha", usage=Usage(prompt_tokens=9, estimated=True), cost_nusd=700),
    DONE,
    ToolCall(id="call_1", name="lookup", arguments='{"q": "x"}'),
    Choice(index=1, content="second"),
    CallShape(json_tool="answer"),
    StreamDelta(text="he", tool_calls=(ToolCallDelta(index=0, arguments="{"),)),
    ToolCallDelta(index=0, id="call_1", name="lookup"),
    EmbeddingResult(vectors=[[0.1, 0.2]], model="m", batches=1),
    Failed(task_id=1, trace_id="t1", reason=FailureReason.TIMEOUT, detail="slow"),
    Expired(task_id=1, trace_id="t1"),
    Cancelled(task_id=1, trace_id="t1"),
    Rejected(task_id=1, trace_id="t1", reason=RejectReason.QUEUE_FULL),
    Result(task_id=1, trace_id="t1"),
    TASK,
    JOB,
    Route(tasks=(TASK,)),
    messages.BudgetFreed(),
    Enqueue(jobs=(JOB,)),
    Ready(model="alpha", incarnation=1, epoch=0, credits=4),
    Call(model="alpha", incarnation=1, epoch=0, jobs=(JOB,)),
    Cancel(task_ids=(1,)),
    Health(model="alpha", breaker=BreakerState.OPEN, reopen_at=3.0),
    Finished(results=(DONE,)),
    AdmitDue(at=1.0),
    ExpireDue(at=2.0),
    EscalateDue(at=3.0),
    CallResult(task_id=1, attempt=1, started_at=0.0, ended_at=0.1, status_code=200),
    CallsDone(incarnation=1, results=()),
    ChildFailed(name="queue", incarnation=1, error="RuntimeError()"),
    RestartChild(name="queue", incarnation=2),
    ChildStopped(name="queue", incarnation=1),
    StartChildren(),
    StopChildren(),
    ReplaceChildren(specs=()),
    CheckLiveness(),
    Redelivered(message="m"),
    Regrant(),
    GetState(),
    LetGo(),
    Crash(),
    GetStats(),
    StatsOverdue(finished=0, reply=Future()),
    Percentiles(count=1, p50=0.1),
    GroupStats(),
    Stats(
        outcomes={},
        failures={},
        total=GroupStats(),
        by_model={},
        by_priority={},
        ledger={},
    ),
]


def _ids(samples: list[Any]) -> list[str]:
    return [type(s).__name__ for s in samples]


def exported_dataclasses() -> list[type]:
    return [
        obj
        for name in messages.__all__
        if dataclasses.is_dataclass(obj := getattr(messages, name)) and isinstance(obj, type)
    ]


# -- frozen, slotted, readable -------------------------------------------------------


@pytest.mark.parametrize("cls", exported_dataclasses(), ids=lambda c: c.__name__)
def test_every_exported_message_type_is_a_frozen_slotted_dataclass(cls: type) -> None:
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen, f"{cls.__name__} must be frozen: pykka does not copy messages"
    assert "__slots__" in cls.__dict__, f"{cls.__name__} must be slotted"


def test_every_exported_message_type_has_a_sample_here() -> None:
    sampled = {type(s) for s in SAMPLES}
    missing = [c.__name__ for c in exported_dataclasses() if c not in sampled]
    assert missing == [], f"add a sample of {missing} to SAMPLES"


@pytest.mark.parametrize("sample", SAMPLES, ids=_ids(SAMPLES))
def test_assignment_to_any_field_raises(sample: Any) -> None:
    for f in dataclasses.fields(sample):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sample, f.name, getattr(sample, f.name))
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
        sample.not_a_field = 1


@pytest.mark.parametrize("sample", SAMPLES, ids=_ids(SAMPLES))
def test_repr_names_the_type_and_its_fields(sample: Any) -> None:
    text = repr(sample)
    assert text.startswith(f"{type(sample).__name__}(")
    assert " object at 0x" not in text
    for f in dataclasses.fields(sample):
        if f.repr:
            assert f"{f.name}=" in text, f"{f.name} missing from {text}"


def test_a_tasks_repr_leaves_out_the_callers_future() -> None:
    assert "future" not in repr(TASK)
    assert "Future" not in repr(TASK)


def test_request_metadata_is_frozen_too() -> None:
    meta = {"user": "ada"}
    req = Request.of("hi", metadata=meta)
    meta["user"] = "eve"
    assert req.metadata["user"] == "ada", "the request holds its own copy"
    with pytest.raises(TypeError):
        req.metadata["user"] = "eve"  # type: ignore[index]


def test_a_requests_own_headers_are_frozen_with_their_names_lower_cased() -> None:
    request = Request.of("hi", extra_headers={"Anthropic-Beta": " a,b ", "X-Title": "t"})
    assert request.extra_headers == {"anthropic-beta": "a,b", "x-title": "t"}
    with pytest.raises(TypeError):
        request.extra_headers["x-title"] = "u"  # type: ignore[index]
    assert Request.of("hi", extra_headers={}).extra_headers is Request.of("hi").extra_headers


def test_a_list_of_messages_is_frozen_into_a_tuple() -> None:
    req = Request(messages=[ChatMessage(role="user", content="hi")])  # type: ignore[arg-type]
    assert isinstance(req.messages, tuple)


def test_results_say_whether_they_are_ok() -> None:
    assert DONE.ok
    assert DONE.text == "hi"
    for result in SAMPLES:
        if isinstance(result, Result) and not isinstance(result, Completed):
            assert not result.ok
            assert result.text is None


# -- requests check themselves ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("priority", "urgent"),
        ("priority", 7),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", True),
        ("max_tokens", 2.5),
        ("max_tokens", 10**9),
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("temperature", "warm"),
        ("temperature", math.nan),
        ("deadline_s", 0),
        ("deadline_s", -1.0),
        ("deadline_s", math.inf),
        ("deadline_s", math.nan),
        ("deadline_s", "soon"),
        ("model", ""),
        ("model", "  "),
        ("model", 5),
        ("route", ""),
        ("idempotency_key", ""),
        ("budget_tag", " "),
        ("metadata", 5),
        ("metadata", "ab"),
        ("metadata", {1: "non-string key"}),
        ("extra_headers", "anthropic-beta: x"),
        ("extra_headers", {"bad name": "x"}),
        ("extra_headers", {"x-a": "two\r\nlines"}),
        ("extra_headers", {"x-a": "caf\u00e9"}),
        ("extra_headers", {"x-a": 7}),
        ("extra_headers", {"X-A": "1", "x-a": "2"}),
        ("extra_headers", {"Content-Length": "9"}),
        ("extra_headers", {"anthropic-version": "2023-01-01"}),
        ("extra_headers", {"Authorization": "Bearer sk-1"}),
        ("extra_headers", {"x-goog-api-key": "k"}),
        ("extra_headers", {f"x-{i}": "v" for i in range(33)}),
    ],
)
def test_a_bad_request_field_raises_invalid_request_error_naming_it(name: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        Request.of("hi", **{name: value})
    assert name in str(info.value)
    assert isinstance(info.value, UsageError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ("", "empty"),
        ("   \n", "empty"),
        (None, "prompt"),
        (42, "prompt"),
        ([], "messages"),
        ([{"role": "user"}], "messages[0]"),
        ([{"role": "user", "content": "x", "extra": 1}], "extra"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}], "role"),
    ],
)
def test_a_bad_prompt_raises_invalid_request_error_naming_the_problem(
    prompt: Any, needle: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        Request.of(prompt)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "messages_value",
    [
        (),
        ("hi",),
        [{"role": "user", "content": "hi"}],
        "hi",
    ],
)
def test_request_built_directly_checks_its_messages(messages_value: Any) -> None:
    with pytest.raises(InvalidRequestError, match="messages"):
        Request(messages=messages_value)


def test_request_of_refuses_a_request_plus_fields() -> None:
    with pytest.raises(InvalidRequestError, match="either"):
        Request.of(Request.of("hi"), priority="high")


@pytest.mark.parametrize(
    ("role", "content", "field"),
    [
        ("robot", "hi", "role"),
        ("USER", "hi", "role"),
        (5, "hi", "role"),
        ("user", 5, "content"),
        ("user", None, "content"),
        (["user"], "hi", "role"),
    ],
)
def test_a_bad_chat_message_names_the_field(role: Any, content: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        ChatMessage(role=role, content=content)


def test_every_documented_role_is_accepted() -> None:
    for role in ("system", "user", "assistant", "tool", "developer"):
        call_id = "c1" if role == "tool" else None  # a tool turn answers a call
        assert ChatMessage(role=role, content="x", tool_call_id=call_id).role == role


def test_request_of_accepts_a_prompt_a_chat_or_a_request() -> None:
    chat = [
        {"role": "system", "content": "Be brief."},
        ChatMessage(role="user", content="Hi"),
        {"role": "user", "content": "Again"},
    ]
    req = Request.of(chat, priority="low")
    assert [m.role for m in req.messages] == ["system", "user", "user"]
    assert req.priority is Priority.LOW
    assert Request.of(req) is req
    assert Request.of("x").messages == (ChatMessage(role="user", content="x"),)


# -- what a queued task holds ----------------------------------------------------------

PROMPT = "summarise ticket #7 in one line."


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"priority": "high", "max_tokens": 16, "temperature": 0.5, "deadline_s": 3.0},
        {"metadata": {"user": "ada"}, "budget_tag": "team-a", "idempotency_key": "k1"},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"response_format": {"type": "json_object"}, "route": "fast"},
    ],
    ids=["plain", "limits", "metadata", "tools", "json"],
)
def test_a_bare_prompt_request_is_indistinguishable_from_one_user_turn(
    fields: dict[str, Any],
) -> None:
    bare = Request.of(PROMPT, **fields)
    turn = Request.of([ChatMessage(role="user", content=PROMPT)], **fields)
    assert bare == turn
    assert repr(bare) == repr(turn)
    assert bare.__getstate__() == turn.__getstate__()  # type: ignore[attr-defined]
    assert bare.messages == turn.messages == (ChatMessage(role="user", content=PROMPT),)
    assert type(bare.messages) is tuple
    assert (bare.plain, bare.needs, bare.wants_json) == (turn.plain, turn.needs, turn.wants_json)
    assert copy.copy(bare) == turn
    assert dataclasses.replace(bare, max_tokens=9) == dataclasses.replace(turn, max_tokens=9)
    for refused in (hash, pickle.dumps, copy.deepcopy):  # its metadata is a read-only view
        with pytest.raises(TypeError) as bare_error:
            refused(bare)
        with pytest.raises(TypeError) as turn_error:
            refused(turn)
        assert str(bare_error.value) == str(turn_error.value)


@pytest.mark.parametrize(
    "result",
    [
        Completed(task_id=1, trace_id="t", content="hi", metadata=MappingProxyType({"a": 1})),
        Failed(task_id=2, trace_id="t", reason=FailureReason.INTERNAL, detail="x"),
        Expired(task_id=3, trace_id="t"),
        Cancelled(task_id=4, trace_id="t", detail="gone"),
        Rejected(task_id=5, trace_id="t", reason=RejectReason.QUEUE_FULL),
    ],
    ids=lambda r: type(r).__name__,
)
def test_a_result_crosses_to_another_process_as_it_was(result: Result) -> None:
    """Its metadata is a read-only view, which does not pickle: a pool's worker
    returning a result failed (found by a hunt). It is read-only again once loaded."""
    again = pickle.loads(pickle.dumps(result))  # noqa: S301 - our own bytes
    assert (type(again), again) == (type(result), result)
    assert type(again.metadata) is MappingProxyType
    assert copy.deepcopy(result) == result


def test_an_unreachable_cluster_error_crosses_to_another_process_as_it_was() -> None:
    error = pickle.loads(pickle.dumps(ClusterUnreachableError("head:6379", "refused")))  # noqa: S301
    assert (str(error), error.address, error.why) == (
        "the Ray cluster at 'head:6379' is unreachable: refused",
        "head:6379",
        "refused",
    )


@pytest.mark.parametrize(
    ("address", "shown"),
    [
        ("ray://admin:hunter2-token@10.0.0.9:10001", "ray://***@10.0.0.9:10001"),
        ("admin:hunter2-token@10.0.0.9:6379", "***@10.0.0.9:6379"),
        ("ray://10.0.0.9:10001", "ray://10.0.0.9:10001"),
        ("auto", "auto"),
    ],
)
def test_an_unreachable_clusters_address_is_said_without_its_credentials(
    address: str, shown: str
) -> None:
    """A ``ray://user:token@host`` address was printed whole (found by a hunt)."""
    said = str(ClusterUnreachableError(address, "refused"))
    assert said == f"the Ray cluster at {shown!r} is unreachable: refused"
    assert "hunter2" not in said


def test_a_bare_prompt_request_holds_the_prompt_itself_and_no_message() -> None:
    request = Request.of(PROMPT)
    held = gc.get_referents(request)
    assert any(value is PROMPT for value in held)
    assert not any(isinstance(value, ChatMessage | tuple) for value in held)
    first, again = request.messages, request.messages
    assert first == again  # each read is a new, equal turn holding the very prompt
    assert first[0].content is PROMPT


def test_a_prompt_of_a_string_subclass_is_held_as_its_message() -> None:
    class Text(str):
        __slots__ = ()

    prompt = Text(PROMPT)
    request = Request.of(prompt)
    assert request.messages[0].content is prompt
    assert request.messages is request.messages


def test_a_bare_prompt_request_refuses_what_one_user_turn_would() -> None:
    for prompt in ("", "  \n"):
        with pytest.raises(InvalidRequestError, match="prompt is empty"):
            Request.of(prompt)
    with pytest.raises(InvalidRequestError, match="not both"):
        Request.of("", input=["a text"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        Request.of(PROMPT).messages = ()  # type: ignore[misc]


def test_a_task_given_a_trace_prefix_reads_its_trace_id_derived() -> None:
    prefix = TracePrefix("1f2e.1")
    derived = Task(task_id=7, trace_id=prefix, request=REQUEST, submitted_at=0.0)
    stored = Task(task_id=7, trace_id="1f2e.1.7", request=REQUEST, submitted_at=0.0)
    assert derived.trace_id == "1f2e.1.7"
    assert type(derived.trace_id) is str
    assert derived == stored
    assert repr(derived) == repr(stored)
    assert derived.__getstate__() == stored.__getstate__()  # type: ignore[attr-defined]
    assert any(value is prefix for value in gc.get_referents(derived))  # shared, not a copy
    assert TaskFuture(7, prefix).trace_id == "1f2e.1.7"
    assert TaskFuture(7, "caller's").trace_id == "caller's"


# -- Priority.parse --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (Priority.HIGH, Priority.HIGH),
        ("critical", Priority.CRITICAL),
        ("HIGH", Priority.HIGH),
        (" Normal ", Priority.NORMAL),
        ("low", Priority.LOW),
        (0, Priority.CRITICAL),
        (1, Priority.HIGH),
        (2, Priority.NORMAL),
        (3, Priority.LOW),
    ],
)
def test_priority_parse_accepts_names_any_case_and_numbers(value: Any, expected: Priority) -> None:
    assert Priority.parse(value) is expected


@pytest.mark.parametrize("value", ["urgent", "", 4, -1, True, False, 1.0, None, "1", [1]])
def test_priority_parse_refuses_anything_else_naming_the_choices(value: Any) -> None:
    with pytest.raises(InvalidRequestError, match="priority") as info:
        Priority.parse(value)
    for name in ("critical", "high", "normal", "low"):
        assert name in str(info.value)


def test_priorities_order_most_urgent_first() -> None:
    assert sorted([Priority.LOW, Priority.CRITICAL, Priority.NORMAL, Priority.HIGH]) == [
        Priority.CRITICAL,
        Priority.HIGH,
        Priority.NORMAL,
        Priority.LOW,
    ]


# -- money is exact ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nusd", "usd"),
    [
        (0, "0"),
        (1, "0.000000001"),
        (1_234, "0.000001234"),
        (1_500_000_000, "1.5"),
        (123_456_789_012_345, "123456.789012345"),
    ],
)
def test_cost_usd_is_the_exact_decimal_of_nano_dollars(nusd: int, usd: str) -> None:
    result = Completed(task_id=1, trace_id="t", content="x", cost_nusd=nusd)
    assert isinstance(result.cost_usd, Decimal)
    assert result.cost_usd == Decimal(usd)


def test_costs_sum_without_drift() -> None:
    results = [Completed(task_id=i, trace_id="t", content="x", cost_nusd=100) for i in range(10)]
    assert sum((r.cost_usd for r in results), Decimal(0)) == Decimal("0.000001")
    assert GroupStats(cost_nusd=10**9).cost_usd == Decimal(1)


def test_usage_total_tokens() -> None:
    assert Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=2).total_tokens == 7


# -- secrets never show ------------------------------------------------------------------

KEY = "sk-test-VERY-SECRET-0123456789"


def test_a_secret_never_shows_its_value() -> None:
    secret = Secret(KEY)
    shown = [
        repr(secret),
        str(secret),
        f"{secret}",
        f"{secret!r}",
        f"{secret!s}",
        "%s" % (secret,),  # noqa: UP031 - the %-formatting path is what is under test
        "%r" % (secret,),  # noqa: UP031 - the %-formatting path is what is under test
        "{}".format(secret),  # noqa: UP032 - str.format is what is under test
        str([secret]),
        repr({"key": secret}),
        repr((secret,)),
    ]
    for text in shown:
        assert KEY not in text
        assert "***" in text
    assert secret.reveal() == KEY
    assert callboard.Secret is Secret


def test_a_secret_compares_by_value_without_showing_it() -> None:
    assert Secret(KEY) == Secret(KEY)
    assert Secret(KEY) != Secret("other")
    assert Secret(KEY) != KEY
    assert len({Secret(KEY), Secret(KEY)}) == 1


def test_a_secret_has_no_attribute_dict_to_leak_through() -> None:
    secret = Secret(KEY)
    with pytest.raises(TypeError):
        vars(secret)
    with pytest.raises(AttributeError):
        secret.extra = 1  # type: ignore[attr-defined]


def test_a_secret_logged_does_not_show(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("callboard.test_messages")
    with caplog.at_level(logging.INFO, logger="callboard.test_messages"):
        log.info("calling with %s and %r", Secret(KEY), Secret(KEY))
    assert caplog.records
    assert KEY not in caplog.text


def test_model_settings_repr_hides_the_api_key() -> None:
    settings = ModelSettings(name="alpha", base_url="https://example.test/v1", api_key=Secret(KEY))
    for text in (repr(settings), str(settings), f"{settings}", repr(dataclasses.asdict(settings))):
        assert KEY not in text
    assert "api_key=Secret('***')" in repr(settings)
    assert settings.api_key is not None
    assert settings.api_key.reveal() == KEY


def test_a_model_settings_error_does_not_show_the_key() -> None:
    with pytest.raises(callboard.ConfigError) as info:
        ModelSettings(name="alpha", base_url="ftp://nope", api_key=Secret(KEY))
    assert KEY not in str(info.value)
    assert KEY not in repr(info.value)


def test_a_message_field_is_carried_and_one_the_api_lacks_is_refused_by_name() -> None:
    request = Request.of([{"role": "user", "content": "Hi", "name": "ada"}])
    assert request.messages[0].wire() == {"role": "user", "content": "Hi", "name": "ada"}
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.nickname"):
        Request.of([{"role": "user", "content": "Hi", "nickname": "ada"}])


@pytest.mark.parametrize("field", ["temperature", "deadline_s"])
def test_a_boolean_is_not_a_number(field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        Request.of("x", **{field: True})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_metadata_that_is_not_strict_json_is_refused(value: float) -> None:
    with pytest.raises(InvalidRequestError, match="metadata cannot be stored as JSON"):
        Request.of("x", metadata={"x": value})


HUGE = 10**5000
"""An integer of more digits than Python writes as text (4,300 by default)."""


def test_an_integer_no_json_can_be_written_of_is_refused_where_it_is() -> None:
    """Accepted, it raised in the model actor each time it made the call's body (the
    system stopped, the supervisor's restarts spent), and in the durable ledger's
    writer (a batch of other tasks' records lost; both found by a hunt)."""
    with pytest.raises(InvalidRequestError, match=r"metadata\['n'\] is an integer of more"):
        Request.of("x", metadata={"n": HUGE})
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": HUGE}}}
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    with pytest.raises(InvalidRequestError, match="maximum"):
        Request.of("x", tools=[tool])
    assert Request.of("x", metadata={"n": 10**4000}).metadata["n"] == 10**4000  # writable
    for name in ("max_tokens", "temperature", "priority", "deadline_s"):
        # each error meant to name it raised ValueError (its repr) or OverflowError
        with pytest.raises(InvalidRequestError, match=f"{name} must .* an integer of 16610 bits"):
            Request.of("x", **{name: HUGE})


def test_a_tool_turn_without_its_call_id_is_refused_even_as_plain_text() -> None:
    with pytest.raises(InvalidRequestError, match="tool_call_id"):
        ChatMessage(role="tool", content="sunny")
    assert ChatMessage(role="tool", content="sunny", tool_call_id="c1").wire() == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "c1",
    }


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("Authorization", True),
        ("x-api-key", True),
        ("apikey", True),
        ("X-Api-Credential", True),
        ("X-Session", True),
        ("X-Api-Pass", True),
        ("x-amz-security-token", True),
        ("passwd", True),
        ("sig", True),
        ("code", True),
        ("userPass", True),
        ("passphrase", True),
        ("apiPwd", True),
        ("sig1", True),
        ("apisig", True),
        ("mot_de_passe", True),
        ("x-session-id", True),
        ("x-design", False),
        ("x-bypass-cache", False),
        ("x-error-code", False),
        ("country_code", False),
        ("x-title", False),
        ("anthropic-beta", False),
    ],
)
def test_a_name_is_a_credential_by_one_rule_for_headers_and_query_parameters(
    name: str, secret: bool
) -> None:
    """Headers and URL query parameters had two lists, so ``X-Session`` was sent as a
    plain header and stored with the request while ``?session=`` was hidden (found by
    a hunt)."""
    assert credential_like(name) is secret


def test_a_null_cap_is_none_given_as_openais_api_reads_it() -> None:
    """The openai SDK sends ``max_tokens: null`` for ``max_tokens=None``: refused, it
    broke every such client pointed at the gateway (found by a hunt)."""
    default = Request.of(PROMPT).max_tokens
    assert Request.of(PROMPT, max_tokens=None).max_tokens == default
    assert Request.of(PROMPT, max_completion_tokens=None).max_tokens == default
    assert Request.of(PROMPT, max_tokens=None, max_completion_tokens=9).max_tokens == 9
    with pytest.raises(InvalidRequestError, match="not both"):
        Request.of(PROMPT, max_tokens=5, max_completion_tokens=9)


def test_a_deltas_result_text_is_its_text_for_choice_zero_only() -> None:
    from callboard.messages import StreamDelta

    assert StreamDelta(text="A1").result_text == "A1"
    assert StreamDelta(text="B1", choice=1).result_text == ""


def test_a_request_made_with_a_model_and_a_route_is_refused_naming_both() -> None:
    """The model won and the route was dropped unsaid, where ``callboard run`` refused
    the same line (found by a hunt). A ledger written before holds such requests: they
    still read (``Request`` itself takes them), and resume."""
    with pytest.raises(InvalidRequestError, match=r"give one of 'model'.*or 'route'"):
        Request.of("hi", model="fast", route="cheap")
    stored = Request(messages=REQUEST.messages, model="fast", route="cheap")
    assert (stored.model, stored.route) == ("fast", "cheap")
    assert Request.of("hi", model="fast", route=None).model == "fast"


def test_an_assistant_tool_turn_may_leave_its_content_out() -> None:
    """As OpenAI's API takes it, and as an SDK's message dumped without its nulls sends
    it: it was a ``TypeError`` (the gateway's 500; found by a test)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = Request.of(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]
    )
    assert request.messages[1].content is None
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.content: needed"):
        Request.of([{"role": "user", "content": "Hi"}, {"role": "assistant"}])
