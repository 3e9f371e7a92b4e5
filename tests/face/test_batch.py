"""The batch job's file formats: input lines in both shapes, every error naming its line,
output records, and resuming from an output file."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import stat
import struct
import tracemalloc
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from callboard.messages import (
    Cancelled,
    ChatMessage,
    Completed,
    Expired,
    Failed,
    FailureReason,
    Priority,
    Rejected,
    RejectReason,
    Usage,
)
from support import write_lines

from callboard.batch import (
    DamagedOutputError,
    Embedding,
    Line,
    LineError,
    NotOurOutputError,
    compact_output,
    error_record,
    parse_line,
    read_output,
    read_requests,
    result_record,
    stale_errors,
)


def finished_ids(path: Path) -> set[str]:
    """What ``callboard run`` skips on a rerun: the ids with a final outcome in ``path``
    (an invalid line's id is not final: the fixed line runs)."""
    return {i for i, status in read_output(path).statuses.items() if status != "invalid"}


def parsed(obj: Any, number: int = 7) -> Line:
    item = parse_line(json.dumps(obj), number)
    assert isinstance(item, Line), item
    assert item.number == number
    return item


def refused(raw: str, number: int = 7) -> LineError:
    item = parse_line(raw, number)
    assert isinstance(item, LineError), item
    assert item.number == number
    assert item.message.startswith(f"line {number}: "), item.message
    return item


# -- callboard's own shape ---------------------------------------------------------


def test_own_shape_with_every_field() -> None:
    line = parsed(
        {
            "id": "q1",
            "prompt": "Say hi",
            "priority": "high",
            "model": "alpha",
            "max_tokens": 64,
            "temperature": 0.2,
            "deadline_s": 30,
            "metadata": {"user": "ada"},
            "idempotency_key": "key-1",
            "budget_tag": "team-a",
            "extra_headers": {"anthropic-beta": "output-128k-2025-02-19"},
        }
    )
    assert line.id == "q1"
    r = line.request
    assert r.messages == (ChatMessage(role="user", content="Say hi"),)
    assert r.priority is Priority.HIGH
    assert (r.model, r.route) == ("alpha", None)
    assert (r.max_tokens, r.temperature, r.deadline_s) == (64, 0.2, 30)
    assert dict(r.metadata) == {"user": "ada"}
    assert (r.idempotency_key, r.budget_tag) == ("key-1", "team-a")
    assert r.extra_headers == {"anthropic-beta": "output-128k-2025-02-19"}


def test_own_shape_with_messages_and_a_route() -> None:
    line = parsed(
        {
            "id": 12,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "route": "fast",
            "priority": 0,
        }
    )
    assert line.id == "12", "integer ids become strings"
    assert [m.role for m in line.request.messages] == ["system", "user"]
    assert line.request.route == "fast"
    assert line.request.priority is Priority.CRITICAL


def test_a_line_without_an_id_is_named_after_its_number() -> None:
    assert parsed({"prompt": "hi"}, number=41).id == "line-41"


def test_defaults_when_only_a_prompt_is_given() -> None:
    r = parsed({"id": "a", "prompt": "hi"}).request
    assert r.priority is Priority.NORMAL
    assert r.model is None
    assert r.max_tokens == 256


# -- OpenAI's batch shape --------------------------------------------------------------


def test_openai_batch_shape() -> None:
    line = parsed(
        {
            "custom_id": "request-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "alpha",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 32,
                "temperature": 0.5,
            },
        }
    )
    assert line.id == "request-1"
    r = line.request
    assert r.model == "alpha"
    assert r.messages == (ChatMessage(role="user", content="Hello"),)
    assert (r.max_tokens, r.temperature) == (32, 0.5)


def test_openai_max_completion_tokens_becomes_max_tokens() -> None:
    line = parsed(
        {
            "custom_id": "r2",
            "body": {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9},
        }
    )
    assert line.request.max_tokens == 9


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({"custom_id": "r", "body": "nope"}, "body"),
        ({"custom_id": "r", "body": {"model": "alpha"}}, "messages"),
        ({"body": {"messages": [{"role": "user", "content": "x"}]}}, "id"),
        ({"custom_id": "", "body": {"messages": [{"role": "user", "content": "x"}]}}, "id"),
        ({"custom_id": "r", "body": {"messages": [{"role": "robot", "content": "x"}]}}, "role"),
        ({"custom_id": "r", "body": {"messages": [{"role": "user", "content": " "}]}}, "empty"),
        # as OpenAI's Batch API reads a line: a GET ran as a POST, and keys of no meaning
        # (an "id" beside "custom_id") were dropped (found by a hunt)
        ({"custom_id": "r", "method": "GET", "body": {"messages": []}}, "'method' must be POST"),
        ({"custom_id": "r", "id": "x", "body": {"messages": []}}, "takes no ['id']"),
        ({"custom_id": "r", "extra": 1, "body": {"messages": []}}, "takes no ['extra']"),
        (
            {
                "custom_id": "r",
                "body": {
                    "messages": [{"role": "user", "content": "x"}],
                    "max_completion_tokens": -1,
                },
            },
            "max_tokens",
        ),
    ],
)
def test_openai_shape_errors_name_the_line_and_the_problem(obj: Any, needle: str) -> None:
    err = refused(json.dumps(obj), number=5)
    assert needle in err.message


def test_openai_shape_error_keeps_the_custom_id() -> None:
    err = refused(json.dumps({"custom_id": "r9", "body": {"messages": []}}))
    assert err.id == "r9"


# -- embeddings lines ------------------------------------------------------------------------


def test_an_embeddings_line_in_callboards_shape() -> None:
    line = parsed(
        {
            "id": "e1",
            "input": ["first", "second"],
            "model": "emb",
            "dimensions": 256,
            "priority": "high",
            "budget_tag": "team-a",
            "user": "ada",
        }
    )
    r = line.request
    assert (r.input, r.messages, r.max_tokens) == (("first", "second"), (), 1)
    assert (r.model, r.priority, r.budget_tag) == ("emb", Priority.HIGH, "team-a")
    # asked for as base64 (cheaper to read), written as floats: the line did not say
    assert dict(r.options) == {"dimensions": 256, "user": "ada", "encoding_format": "base64"}
    assert line.embedding == Embedding(count=2, single=False, keep_base64=False, dimensions=256)


def test_one_text_is_written_as_one_embedding() -> None:
    line = parsed({"id": "e", "input": "just one", "encoding_format": "float"})
    assert line.request.input == ("just one",)
    assert line.request.options["encoding_format"] == "float"
    assert line.embedding == Embedding(count=1, single=True, keep_base64=False, dimensions=None)


def test_an_embeddings_line_in_openais_batch_shape() -> None:
    line = parsed(
        {
            "custom_id": "r1",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {
                "model": "text-embedding-3-small",
                "input": ["a", "b"],
                "dimensions": 8,
                "encoding_format": "base64",
            },
        }
    )
    assert line.id == "r1"
    assert line.request.input == ("a", "b")
    assert line.request.model == "text-embedding-3-small"
    assert line.embedding is not None
    assert line.embedding.keep_base64, "base64 asked for: written as the provider sent it"


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({"id": "e", "input": []}, "input is empty"),
        ({"id": "e", "input": ["a", ""]}, "input[1]"),
        ({"id": "e", "input": ["a", 3]}, "input[1]"),
        ({"id": "e", "input": {"a": 1}}, "input must be a string or a list"),
        ({"id": "e", "input": "a", "max_tokens": 5}, "takes no max_tokens"),
        ({"id": "e", "input": "a", "prompt": "b"}, "takes no prompt"),
        ({"id": "e", "input": "a", "dimensions": 0}, "dimensions"),
        ({"id": "e", "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"id": "e", "input": ["a"] * 2049}, "1 to 2048"),
        ({"custom_id": "r", "url": "/v1/embeddings", "body": {"model": "m"}}, "no 'input'"),
        (
            {"custom_id": "r", "url": "/v1/embeddings", "body": {"input": "a", "seed": 1}},
            "takes no body.seed",
        ),
        (
            {"custom_id": "r", "url": "/v1/embeddings", "body": {"input": [[1, -2]]}},
            "body.input[0]",
        ),
        (
            {"custom_id": "r", "url": "/v1/responses", "body": {"input": "a"}},
            "'url' must be one of /v1/chat/completions, /v1/embeddings",
        ),
    ],
)
def test_a_bad_embeddings_line_names_its_line_and_the_problem(obj: Any, needle: str) -> None:
    err = refused(json.dumps(obj), number=9)
    assert needle in err.message


def _embedded(vectors: list[Any], order: list[int]) -> Completed:
    items = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return Completed(
        task_id=3,
        trace_id="t",
        model="emb",
        content="",
        usage=Usage(prompt_tokens=6),
        cost_nusd=120,
        raw={"object": "list", "data": [items[i] for i in order]},
    )


def test_the_record_of_an_embeddings_line_carries_its_vectors_in_input_order() -> None:
    packed = [base64.b64encode(struct.pack("<2f", x, 1.0)).decode() for x in (1.0, 2.0)]
    result = _embedded(packed, order=[1, 0])
    many = Embedding(count=2, single=False, keep_base64=False, dimensions=2)
    record = result_record("e", result, embedding=many)
    assert record["embeddings"] == [[1.0, 1.0], [2.0, 1.0]]
    assert (record["status"], record["usage"]["prompt_tokens"], record["cost_usd"]) == (
        "completed",
        6,
        "0.00000012",
    )
    assert "text" not in record
    assert "finish_reason" not in record
    kept = result_record("e", result, embedding=dataclasses.replace(many, keep_base64=True))
    assert kept["embeddings"] == packed
    assert json.loads(json.dumps(record)) == record


def test_the_record_of_one_text_carries_one_embedding() -> None:
    one = Embedding(count=1, single=True, keep_base64=False, dimensions=None)
    record = result_record("e", _embedded([[0.5, 0.25]], order=[0]), embedding=one)
    assert record["embedding"] == [0.5, 0.25]
    assert "embeddings" not in record


def test_an_embeddings_answer_that_cannot_be_used_is_written_failed() -> None:
    many = Embedding(count=3, single=False, keep_base64=False, dimensions=None)
    record = result_record("e", _embedded([[1.0], [2.0]], order=[0, 1]), embedding=many)
    assert (record["ok"], record["status"]) == (False, "failed")
    assert record["error"]["reason"] == "malformed_response"
    assert "answered 2 vectors for 3 texts" in record["error"]["detail"]
    assert "embeddings" not in record


# -- every error names its line ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ('{"id": "a", "prompt": ', "not valid JSON"),
        ("not json at all", "not valid JSON"),
        ('["a", "list"]', "expected a JSON object"),
        ('"a string"', "expected a JSON object"),
        ("42", "expected a JSON object"),
        ('{"id": "a", "prompt": "x", "colour": "red"}', "colour"),
        ('{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "one of"),
        ('{"id": "a"}', "one of"),
        ('{"id": "a", "prompt": ""}', "empty"),
        ('{"id": "a", "prompt": "   "}', "empty"),
        ('{"id": "a", "prompt": "x", "max_tokens": -5}', "max_tokens"),
        ('{"id": "a", "prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"id": "a", "prompt": "x", "max_tokens": "many"}', "max_tokens"),
        ('{"id": "a", "prompt": "x", "priority": "urgent"}', "priority"),
        ('{"id": "a", "prompt": "x", "priority": 9}', "priority"),
        ('{"id": "a", "prompt": "x", "temperature": 7}', "temperature"),
        ('{"id": "a", "prompt": "x", "deadline_s": -1}', "deadline_s"),
        ('{"id": "a", "prompt": "x", "model": ""}', "model"),
        ('{"id": "a", "prompt": "x", "model": "m", "route": "r"}', "one of 'model'"),
        ('{"id": "a", "input": "x", "model": "m", "route": "r"}', "one of 'model'"),
        ('{"id": "a", "prompt": 5}', "prompt"),
        ('{"id": "a", "messages": [{"role": "user"}]}', "messages[0]"),
        ('{"id": "a", "messages": ["hi"]}', "messages[0]"),
        ('{"id": true, "prompt": "x"}', "id"),
        ('{"id": ["x"], "prompt": "x"}', "id"),
    ],
)
def test_every_bad_line_is_a_line_error_naming_its_number(raw: str, needle: str) -> None:
    err = refused(raw, number=13)
    assert needle in err.message


def test_an_error_keeps_the_lines_own_id_when_it_has_one() -> None:
    assert refused('{"id": "mine", "prompt": ""}').id == "mine"
    assert refused("{broken", number=3).id == "line-3"
    assert refused("[1]", number=4).id == "line-4"


def test_a_metadata_string_is_a_line_error_not_a_crash() -> None:
    err = refused('{"id": "a", "prompt": "x", "metadata": "ab"}', number=8)
    assert "metadata" in err.message


def test_a_metadata_number_is_a_line_error() -> None:
    refused('{"id": "a", "prompt": "x", "metadata": 5}', number=8)


# -- reading a file ---------------------------------------------------------------------------


def test_read_requests_skips_blank_lines_and_numbers_lines_as_in_the_file(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            '{"id": "a", "prompt": "one"}',
            "",
            "   ",
            '{"id": "b", "prompt": ""}',
            '{"id": "c", "prompt": "three"}',
        ],
    )
    items = list(read_requests(path))
    assert [(type(i).__name__, i.number, i.id) for i in items] == [
        ("Line", 1, "a"),
        ("LineError", 4, "b"),
        ("Line", 5, "c"),
    ]


def test_a_duplicate_id_is_an_error_naming_its_line(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            '{"id": "a", "prompt": "one"}',
            '{"id": "b", "prompt": "two"}',
            '{"id": "a", "prompt": "again"}',
            '{"custom_id": "b", "body": {"messages": [{"role": "user", "content": "x"}]}}',
        ],
    )
    items = list(read_requests(path))
    assert isinstance(items[0], Line)
    assert isinstance(items[1], Line)
    for item, number, ident in ((items[2], 3, "a"), (items[3], 4, "b")):
        assert isinstance(item, LineError)
        assert item.number == number
        assert item.message == f"line {number}: duplicate id {ident!r} (an earlier line has it)"
        assert item.id == f"line-{number}"  # its record must not mark the first line done


def test_a_lines_key_never_names_an_earlier_lines_own_id(tmp_path: Path) -> None:
    """A line keyed ``line-3`` by its number, after a line whose own id is ``line-3``,
    was taken for that line: already done, never sent, and nothing said."""
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            '{"id": "line-3", "prompt": "one"}',
            '{"id": "line-4", "prompt": "two"}',
            '{"prompt": "no id"}',
            '{"id": "a", "prompt": "three"}',
            '{"id": "a", "prompt": "a duplicate"}',
        ],
    )
    keys = [item.id for item in read_requests(path)]
    assert keys == ["line-3", "line-4", "line-3-2", "a", "line-5"]
    assert len(set(keys)) == len(keys)


def test_an_invalid_lines_key_is_its_id_only_if_that_is_an_id() -> None:
    """``"id": true`` keyed its error ``"True"``, which a later line's real id then met
    as a duplicate."""
    assert parse_line('{"id": true, "prompt": "x"}', 7).id == "line-7"
    assert parse_line('{"id": 12, "prompt": ""}', 7).id == "12"
    assert parse_line('{"custom_id": ["x"], "body": {}}', 7).id == "line-7"


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ('{"id": 1, "prompt": "x", "metadata": {"n": ' + "9" * 5000 + "}}", "not readable JSON"),
        ('{"id": "bad\\ud800", "prompt": "x"}', "lone surrogate"),
        ('{"id": "a", "prompt": "x", "idempotency_key": "k\\udfff"}', "lone surrogate"),
    ],
    ids=["huge-integer", "surrogate-id", "surrogate-key"],
)
def test_a_line_python_cannot_hold_is_an_invalid_line_not_a_crash(raw: str, said: str) -> None:
    """An integer of more than 4,300 digits raised a ValueError that ended every run at
    its line; an id with a lone surrogate failed the ledger's commit for its whole
    group, silently (found by a hunt)."""
    error = parse_line(raw, 9)
    assert isinstance(error, LineError), error
    assert error.message.startswith("line 9: ")
    assert said in error.message


def test_a_byte_order_mark_before_the_first_line_is_not_part_of_it(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    items = list(read_requests(path))
    assert [(type(i).__name__, i.id) for i in items] == [("Line", "a"), ("Line", "b")]


def test_an_undecodable_line_is_a_line_error_and_the_rest_is_read(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'{"id": "a", "prompt": "one"}\n'
        b'{"id": "b", "prompt": "\xff\xfe"}\n'
        b'{"id": "c", "prompt": "three"}\n'
    )
    items = list(read_requests(path))
    assert [(type(i).__name__, i.number) for i in items] == [
        ("Line", 1),
        ("LineError", 2),
        ("Line", 3),
    ]


def test_absurdly_nested_json_is_a_line_error() -> None:
    refused("[" * 100_000, number=2)


def test_read_requests_is_lazy(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", ['{"id": "a", "prompt": "one"}', "{bad"])
    items = read_requests(path)
    first = next(items)
    assert isinstance(first, Line)
    assert isinstance(next(items), LineError)
    with pytest.raises(StopIteration):
        next(items)


# -- output records ----------------------------------------------------------------------------


def test_result_record_of_a_completed_result() -> None:
    result = Completed(
        task_id=4,
        trace_id="t",
        model="alpha",
        attempts=2,
        latency_s=0.123456,
        queue_wait_s=0.0100004,
        usage=Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=2),
        cost_nusd=1_234,
        content="Hello!",
        finish_reason="stop",
        metadata=MappingProxyType({"user": "ada"}),
    )
    record = result_record("q1", result)
    assert record == {
        "id": "q1",
        "ok": True,
        "status": "completed",
        "model": "alpha",
        "attempts": 2,
        "latency_s": 0.1235,
        "queue_wait_s": 0.01,
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "cached_tokens": 2,
            "reasoning_tokens": 0,
            "cache_write_tokens": 0,
            "cache_write_1h_tokens": 0,
        },
        "cost_usd": "0.000001234",
        "task_id": 4,
        "text": "Hello!",
        "finish_reason": "stop",
        "metadata": {"user": "ada"},
    }
    assert json.loads(json.dumps(record)) == record


def test_result_record_carries_the_providers_request_id_when_it_said_one() -> None:
    failed = Failed(
        task_id=1,
        trace_id="t",
        reason=FailureReason.PROVIDER_ERROR,
        status_code=500,
        request_id="req_7f3e0c2a9b",
    )
    assert result_record("q1", failed)["request_id"] == "req_7f3e0c2a9b"
    assert "request_id" not in result_record("q1", dataclasses.replace(failed, request_id=None))


@pytest.mark.parametrize(
    ("result", "status", "error"),
    [
        (
            Failed(
                task_id=1,
                trace_id="t",
                reason=FailureReason.PROVIDER_ERROR,
                status_code=503,
                detail="upstream down",
            ),
            "failed",
            {
                "type": "Failed",
                "reason": "provider_error",
                "status_code": 503,
                "detail": "upstream down",
            },
        ),
        (
            Failed(task_id=1, trace_id="t", reason=FailureReason.TIMEOUT),
            "failed",
            {"type": "Failed", "reason": "timeout", "detail": ""},
        ),
        (
            Rejected(task_id=1, trace_id="t", reason=RejectReason.QUEUE_FULL, detail="full"),
            "rejected",
            {"type": "Rejected", "reason": "queue_full", "detail": "full"},
        ),
        (
            Expired(task_id=1, trace_id="t", detail="deadline passed"),
            "expired",
            {"type": "Expired", "detail": "deadline passed"},
        ),
        (
            Cancelled(task_id=1, trace_id="t", detail="system stopped"),
            "cancelled",
            {"type": "Cancelled", "detail": "system stopped"},
        ),
    ],
)
def test_result_record_of_a_result_that_is_not_ok(
    result: Any, status: str, error: dict[str, Any]
) -> None:
    record = result_record("q2", result)
    assert record["id"] == "q2"
    assert record["ok"] is False
    assert record["status"] == status
    assert record["error"] == error
    assert "text" not in record
    assert "metadata" not in record, "empty metadata is left out"
    assert record["cost_usd"] == "0"
    assert json.loads(json.dumps(record)) == record


def test_a_small_cost_is_written_as_plain_decimal_text() -> None:
    """``str`` wrote ``2.9E-7`` beside ``0.008125`` in one column (found by a hunt)."""
    result = Completed(
        task_id=1, trace_id="t", model="m", content="x", usage=Usage(prompt_tokens=1), cost_nusd=290
    )
    assert result_record("q", result)["cost_usd"] == "0.00000029"


def test_error_record_shape() -> None:
    err = LineError(9, "q9", "line 9: request prompt is empty")
    assert error_record(err) == {
        "id": "q9",
        "ok": False,
        "status": "invalid",
        "error": {"type": "InvalidRequest", "line": 9, "detail": "line 9: request prompt is empty"},
    }


# -- resuming ----------------------------------------------------------------------------------


def test_finished_ids_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    assert finished_ids(tmp_path / "nothing.jsonl") == set()


def test_finished_ids_counts_results_but_not_invalid_lines_or_cancels(tmp_path: Path) -> None:
    done = Completed(task_id=1, trace_id="t", content="x")
    timed_out = Failed(task_id=2, trace_id="t", reason=FailureReason.TIMEOUT)
    path = write_lines(
        tmp_path / "out.jsonl",
        [
            json.dumps(result_record("a", done)),
            json.dumps(result_record("b", timed_out)),
            json.dumps(result_record("c", Cancelled(task_id=3, trace_id="t"))),
            json.dumps(error_record(LineError(4, "d", "line 4: bad"))),
            json.dumps({"id": 5, "status": "completed"}),
        ],
    )
    assert finished_ids(path) == {"a", "b", "5"}  # a fixed line 'd' runs next time
    assert read_output(path).statuses["d"] == "invalid"


@pytest.mark.parametrize(
    "line",
    [json.dumps(["not", "a", "record"]), json.dumps({"no": "id"}), "plain notes", "\u00ff"],
)
def test_an_output_with_a_line_that_is_not_ours_is_refused(tmp_path: Path, line: str) -> None:
    done = json.dumps(result_record("a", Completed(task_id=1, trace_id="t", content="x")))
    path = write_lines(tmp_path / "out.jsonl", [done, line, done])
    with pytest.raises(NotOurOutputError, match="line 2"):
        read_output(path)


def test_compacting_keeps_the_last_line_of_each_id_in_first_seen_order(tmp_path: Path) -> None:
    bad = json.dumps(error_record(LineError(1, "a", "line 1: bad")))
    b = json.dumps(result_record("b", Completed(task_id=2, trace_id="t", content="y")))
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    path = write_lines(tmp_path / "out.jsonl", [bad, b, a])
    compact_output(path)
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b"]
    assert read_output(path).statuses == {"a": "completed", "b": "completed"}


def test_compacting_holds_the_places_of_the_lines_not_the_lines(tmp_path: Path) -> None:
    """It held every line it kept: a 300 MB output with one id doubled peaked at 354 MB,
    and a multi-GB embeddings output would not fit (found by a hunt)."""
    text = "x" * 100_000
    lines = [
        json.dumps(result_record(f"i{k}", Completed(task_id=k, trace_id="t", content=text)))
        for k in range(200)
    ]
    path = write_lines(tmp_path / "out.jsonl", [*lines, lines[7]])  # 20 MB, i7 twice
    tracemalloc.start()
    try:
        compact_output(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000  # a line or two at a time, not 20 MB
    kept = [json.loads(x)["id"] for x in path.read_text().splitlines()]
    assert kept == [f"i{k}" for k in range(200)]


def test_finished_ids_skips_a_torn_last_line(tmp_path: Path) -> None:
    good = json.dumps(result_record("a", Completed(task_id=1, trace_id="t", content="x")))
    torn = json.dumps(result_record("b", Completed(task_id=2, trace_id="t", content="y")))
    path = tmp_path / "out.jsonl"
    path.write_text(good + "\n" + torn[: len(torn) // 2], encoding="utf-8")
    assert finished_ids(path) == {"a"}


def test_a_cancelled_then_completed_id_is_finished(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "out.jsonl",
        [
            json.dumps(result_record("a", Cancelled(task_id=1, trace_id="t"))),
            json.dumps(result_record("a", Completed(task_id=2, trace_id="t", content="x"))),
        ],
    )
    assert finished_ids(path) == {"a"}


def test_a_result_record_keeps_the_digest_and_says_an_unpriced_cost_is_unknown() -> None:
    result = Completed(task_id=1, trace_id="t", model="m", content="x")
    record = result_record("a", result, digest="ab" * 32, priced=False)
    assert record["request_sha256"] == "ab" * 32
    assert record["cost_usd"] is None, "unknown, not $0"
    assert result_record("a", result)["cost_usd"] == "0"
    assert "request_sha256" not in result_record("a", result)


def test_read_output_keeps_the_digest_of_each_ids_last_line(tmp_path: Path) -> None:
    done = Completed(task_id=1, trace_id="t", content="x")
    path = write_lines(
        tmp_path / "out.jsonl",
        [
            json.dumps(result_record("a", done, digest="1" * 64)),
            json.dumps(result_record("b", done, digest="2" * 64)),
            json.dumps(result_record("b", done)),  # written by an older version: no digest
        ],
    )
    assert read_output(path).digests == {"a": "1" * 64}


@pytest.mark.parametrize("garbage", ["\x00" * 40, "not json", '{"id": "x"}'])
def test_a_line_that_is_not_a_record_between_records_is_damage_naming_the_line(
    tmp_path: Path, garbage: str
) -> None:
    done = json.dumps(result_record("a", Completed(task_id=1, trace_id="t", content="x")))
    path = write_lines(tmp_path / "out.jsonl", [done, done, garbage, done, garbage, done])
    with pytest.raises(DamagedOutputError, match=r"is damaged: lines 3, 5 between") as caught:
        read_output(path)
    assert str(path) in str(caught.value)
    assert "Remove those lines" in str(caught.value)


def test_a_file_with_no_record_at_all_is_not_ours_rather_than_damaged(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "notes.txt", ["my notes", "more notes"])
    with pytest.raises(NotOurOutputError, match="line 1 is not a callboard result record") as e:
        read_output(path)
    assert not isinstance(e.value, DamagedOutputError)


def test_stale_errors_are_line_keyed_error_records_no_line_is_keyed_by_any_more() -> None:
    statuses = {
        "line-2": "invalid",  # line 2 has an id of its own now: stale
        "line-3": "invalid",  # still keyed line-3 (still broken): kept
        "named": "invalid",  # an id of its own: it may belong to another input, kept
        "line-9": "completed",  # a result, not an error record: kept
    }
    assert stale_errors(statuses, {"line-3", "fixed"}) == {"line-2"}


def test_compacting_drops_the_ids_asked(tmp_path: Path) -> None:
    bad = json.dumps(error_record(LineError(2, "line-2", "line 2: bad")))
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    path = write_lines(tmp_path / "out.jsonl", [bad, a])
    compact_output(path, drop={"line-2"})
    assert read_output(path).statuses == {"a": "completed"}


def test_compacting_keeps_the_files_permissions_and_owner(tmp_path: Path) -> None:
    """The rewrite made a 0600 results file 0644 (the umask's), its results readable by
    everyone, and root's (found by a hunt)."""
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    path = write_lines(tmp_path / "out.jsonl", [a, a])
    path.chmod(0o600)
    owner = (os.getuid() + 1, os.getgid() + 1) if os.getuid() == 0 else None
    if owner is not None:  # as root: given away, as a run for another user leaves it
        os.chown(path, *owner)
    compact_output(path)
    assert read_output(path).statuses == {"a": "completed"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    if owner is not None:
        assert (path.stat().st_uid, path.stat().st_gid) == owner


def test_read_output_counts_the_lines_an_earlier_line_of_their_id_stands_before(
    tmp_path: Path,
) -> None:
    """A run killed after writing a replacing line, before its rewrite, left two lines
    for one id, and no later run rewrote them (each rewrote only what it replaced)."""
    bad = json.dumps(error_record(LineError(1, "a", "line 1: bad")))
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    b = json.dumps(result_record("b", Completed(task_id=4, trace_id="t", content="y")))
    assert read_output(write_lines(tmp_path / "once.jsonl", [a, b])).doubled == 0
    assert read_output(write_lines(tmp_path / "twice.jsonl", [bad, b, a])).doubled == 1


def test_compacting_skips_a_line_torn_by_a_failed_write(tmp_path: Path) -> None:
    """A full disk tore the last line mid-run; the rewrite at the end raised
    JSONDecodeError with a traceback and left the file doubled."""
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    torn = json.dumps(result_record("b", Completed(task_id=4, trace_id="t", content="y")))
    path = tmp_path / "out.jsonl"
    path.write_text(f"{a}\n{a}\n{torn[:20]}", encoding="utf-8")
    compact_output(path)
    assert path.read_text(encoding="utf-8") == a + "\n"  # b runs again
    assert not list(tmp_path.glob("*.compacting"))


def test_compacting_through_a_symbolic_link_rewrites_the_file_it_names(tmp_path: Path) -> None:
    bad = json.dumps(error_record(LineError(1, "a", "line 1: bad")))
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    real = write_lines(tmp_path / "real.jsonl", [bad, a])
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    compact_output(link)
    assert link.is_symlink()  # it was replaced by a file of its own; real kept both lines
    assert read_output(real).statuses == {"a": "completed"}
    assert real.read_text(encoding="utf-8").count("\n") == 1


@pytest.mark.parametrize("left", ["a link to a file", "a link to nothing", "a stale file"])
def test_a_compacting_file_left_in_the_way_is_replaced_never_written_through(
    tmp_path: Path, left: str
) -> None:
    """A symbolic link at ``OUTPUT.compacting`` (planted, or left by a tool) was opened
    through: the file it named was overwritten with the results, and the link was
    renamed over the output (found by a hunt). The rewrite makes a file of its own
    there; one a killed rewrite left is replaced, as it was."""
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    path = write_lines(tmp_path / "out.jsonl", [a, a])
    path.chmod(0o640)
    stale = tmp_path / "out.jsonl.compacting"
    victim = tmp_path / "victim.txt"
    if left == "a link to a file":
        victim.write_text("somebody's data", encoding="utf-8")
        stale.symlink_to(victim)
    elif left == "a link to nothing":
        stale.symlink_to(victim)
    else:
        stale.write_text(a[:10], encoding="utf-8")  # half a rewrite, killed
    compact_output(path)
    assert not path.is_symlink()
    assert path.read_text(encoding="utf-8") == a + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not stale.is_symlink()
    assert not stale.exists()
    if left == "a link to a file":
        assert victim.read_text(encoding="utf-8") == "somebody's data"
    else:
        assert not victim.exists()


def test_a_results_reasoning_and_signed_thinking_are_in_its_line() -> None:
    """Paid for (its tokens are output), they were left out of the output though the
    ledger held them (found by a hunt)."""
    signed = {"type": "thinking", "thinking": "2+2 is 4", "signature": "EqQB"}
    result = Completed(
        task_id=1,
        trace_id="t",
        content="4",
        reasoning="2+2 is 4",
        thinking_blocks=(signed,),
    )
    record = json.loads(json.dumps(result_record("q", result)))
    assert record["reasoning"] == "2+2 is 4"
    assert record["thinking_blocks"] == [signed]
    plain = result_record("q", Completed(task_id=1, trace_id="t", content="4"))
    assert "reasoning" not in plain
    assert "thinking_blocks" not in plain
