"""The batch job's file formats: JSONL requests in, JSONL results out.

An input line is either callboard's own shape::

    {"id": "q1", "prompt": "...", "priority": "high", "model": "sim-fast",
     "max_tokens": 64, "temperature": 0.2, "deadline_s": 30, "metadata": {...}}

(``messages`` instead of ``prompt``; ``route`` instead of ``model``), or
OpenAI's batch-file shape: ``{"custom_id": ..., "body": {"model", "messages",
"max_tokens", ...}}``. Every bad line becomes a ``LineError`` naming the line
number and the problem; it never stops the other lines.

An output line is one JSON object per input id (see ``result_record``); a
result line carries ``request_sha256``, the digest of what its request asked,
so a later run can tell that a line changed since. A line with no usable id
(bad JSON, no ``id``, a duplicate) is keyed ``line-N`` by its line number.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from callboard._embed import (
    UnusableAnswerError,
    embedding_request,
    ordered_vectors,
    texts_of,
)
from callboard.core.pricing import usd_text
from callboard.messages import (
    EMBEDDING_OPTIONS,
    FIELDS,
    OPTIONS,
    Completed,
    Failed,
    InvalidRequestError,
    Rejected,
    Request,
    Result,
    lone_surrogate,
    one_target,
)
from callboard.runtime.durable import sync_folder

OWN_KEYS = frozenset(
    {
        "id",
        "prompt",
        "messages",
        "model",
        "route",
        "priority",
        "max_tokens",
        "temperature",
        "deadline_s",
        "metadata",
        "idempotency_key",
        "budget_tag",
        "extra_headers",
    }
)
OWN_KEYS |= OPTIONS | {"max_completion_tokens"}
BODY_KEYS = FIELDS - {"stream", "stream_options"}
"""What an OpenAI batch line's ``body`` passes on: every Chat Completions field but
those callboard owns (``stream``, ``stream_options``: ignored, a line is answered
whole)."""
EMBEDDING_KEYS = frozenset(
    {"id", "input", "model", "route", "priority", "deadline_s", "metadata", "budget_tag"}
    | EMBEDDING_OPTIONS
)
"""The keys of an embeddings line in callboard's own shape."""
EMBEDDING_BODY_KEYS = frozenset({"model", "input"} | EMBEDDING_OPTIONS) - {"extra_body"}
"""What an OpenAI batch line's ``body`` for ``/v1/embeddings`` may hold."""
URLS = ("/v1/chat/completions", "/v1/embeddings")
"""The endpoints an OpenAI batch line may name (none: chat completions)."""


@dataclass(frozen=True, slots=True)
class Embedding:
    """How an embeddings line's vectors are written."""

    count: int
    """The texts it holds (one vector each)."""
    single: bool
    """``input`` was one string: the record carries ``embedding`` (one vector), not
    ``embeddings`` (a list)."""
    keep_base64: bool
    """The line asked for base64: its vectors are written as the provider sent them."""
    dimensions: int | None


@dataclass(frozen=True, slots=True)
class Line:
    number: int
    id: str
    request: Request
    embedding: Embedding | None = None
    """Set for an embeddings line."""


@dataclass(frozen=True, slots=True)
class LineError:
    number: int
    id: str
    message: str


def read_requests(path: Path) -> Iterator[Line | LineError]:
    """Parse a JSONL file lazily; blank lines are skipped, ids must be unique.

    A line without an id (and a line whose id cannot be used: a duplicate, or not a
    string or integer) is keyed ``line-N`` (its line number), or ``line-N-2``,
    ``line-N-3``... when an earlier line's own id is that: one key never names two
    lines (a line without an id keyed as an earlier line's id was taken for that line,
    already done, and never sent)."""
    seen: set[str] = set()
    given: dict[str, int] = {}
    """The keys callboard gave lines with no usable id of their own, and those lines."""
    with path.open("rb") as fh:
        for number, read in enumerate(fh, 1):
            data = read.removeprefix(_BOM) if number == 1 else read  # saved by Windows tools
            if not data.strip():
                continue
            fallback = _free(f"line-{number}", seen)
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                item: Line | LineError = LineError(
                    number, fallback, f"line {number}: not UTF-8 ({exc.reason})"
                )
            else:
                item = parse_line(raw, number, fallback)
            if item.id in seen:  # its record gets the line's own key: the first keeps its id
                if item.id in given and item.id != fallback:
                    why = (
                        f"callboard gave that id to line {given[item.id]}, which has no "
                        "usable id of its own; give this line another id"
                    )
                else:
                    why = "an earlier line has it"
                message = f"line {number}: duplicate id {item.id!r} ({why})"
                item = LineError(number, fallback, message)
            if item.id == fallback:
                given[fallback] = number
            seen.add(item.id)
            yield item


_BOM = b"\xef\xbb\xbf"


def _free(key: str, seen: set[str]) -> str:
    """``key``, or ``key-2``, ``key-3``... the first no line so far has."""
    if key not in seen:
        return key
    n = 2
    while f"{key}-{n}" in seen:
        n += 1
    return f"{key}-{n}"


def parse_line(raw: str, number: int, fallback_id: str | None = None) -> Line | LineError:
    """One line; ``fallback_id`` keys it if it names no usable id (``line-N``)."""
    fallback_id = fallback_id or f"line-{number}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return LineError(number, fallback_id, f"line {number}: not valid JSON ({exc.msg})")
    except RecursionError:
        return LineError(number, fallback_id, f"line {number}: JSON nested too deeply")
    except ValueError as exc:  # an integer of more digits than Python reads (4,300)
        return LineError(number, fallback_id, f"line {number}: not readable JSON ({exc})")
    if not isinstance(obj, dict):
        return LineError(number, fallback_id, f"line {number}: expected a JSON object")
    try:
        if "custom_id" in obj or "body" in obj:
            line = _openai_batch(obj, number)
        else:
            line = _own(obj, number, fallback_id)
    except InvalidRequestError as exc:
        return LineError(number, _key_of(obj, fallback_id), f"line {number}: {exc}")
    return line


def _key_of(obj: Mapping[str, Any], fallback_id: str) -> str:
    """The key of an invalid line: its id if that is one an id may be (a string or an
    integer; ``true`` is not ``"True"``), else ``fallback_id``."""
    for name in ("custom_id", "id"):
        if name in obj:
            try:
                return _ident(obj[name])
            except InvalidRequestError:
                return fallback_id
    return fallback_id


def _own(obj: Mapping[str, Any], number: int, fallback_id: str) -> Line:
    one_target(obj)
    if "input" in obj:
        return _embedding_line(obj, number, _ident(obj.get("id", fallback_id)), "")
    unknown = sorted(set(obj) - OWN_KEYS)
    if unknown:
        raise InvalidRequestError(f"unknown keys {unknown} (allowed: {sorted(OWN_KEYS)})")
    ident = _ident(obj.get("id", fallback_id))
    if ("prompt" in obj) == ("messages" in obj):
        raise InvalidRequestError(
            "give exactly one of 'prompt' or 'messages' (or 'input': texts to embed)"
        )
    prompt = obj["prompt"] if "prompt" in obj else obj["messages"]
    fields = {k: v for k, v in obj.items() if k not in {"id", "prompt", "messages"}}
    return Line(number, ident, _request(prompt, fields))


def _embedding_line(obj: Mapping[str, Any], number: int, ident: str, where: str) -> Line:
    """An embeddings line (``where``: ``"body."`` for OpenAI's shape, whose keys are
    its body's)."""
    allowed = EMBEDDING_KEYS if not where else EMBEDDING_BODY_KEYS
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise InvalidRequestError(
            f"an embeddings line takes no {', '.join(where + k for k in unknown)} "
            f"(allowed: {sorted(allowed)})"
        )
    texts, single = texts_of(obj["input"], f"{where}input")
    fields = {k: v for k, v in obj.items() if k not in ("id", "input")}
    asked = fields.get("encoding_format")
    fields["encoding_format"] = asked or "base64"  # cheaper to read; written as asked
    dimensions = fields.get("dimensions")
    try:
        request = embedding_request(texts, fields)
    except TypeError as exc:  # a field of the wrong shape that dataclass init rejected
        raise InvalidRequestError(str(exc)) from exc
    shape = Embedding(
        count=len(texts),
        single=single,
        keep_base64=asked == "base64",
        dimensions=dimensions if isinstance(dimensions, int) else None,
    )
    return Line(number, ident, request, shape)


_BATCH_KEYS = frozenset({"custom_id", "method", "url", "body"})
"""The keys of a line of OpenAI's Batch API input file (its reference: "The per-line
object of the batch input file")."""


def _openai_batch(obj: Mapping[str, Any], number: int) -> Line:
    ident = _ident(obj.get("custom_id"))
    unknown = sorted(set(obj) - _BATCH_KEYS)
    if unknown:  # dropped, they changed nothing the caller could see (found by a hunt)
        raise InvalidRequestError(
            f"a Batch API line takes no {unknown} (allowed: {sorted(_BATCH_KEYS)})"
        )
    method = obj.get("method", "POST")
    if method != "POST":  # a GET or DELETE ran as a POST
        raise InvalidRequestError(f"'method' must be POST, got {method!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidRequestError("'body' must be an object")
    url = obj.get("url", URLS[0])
    if url not in URLS:
        raise InvalidRequestError(f"'url' must be one of {', '.join(URLS)}, got {url!r}")
    if url == "/v1/embeddings":
        if "input" not in body:
            raise InvalidRequestError("'body' has no 'input' (the texts to embed)")
        return _embedding_line(body, number, ident, "body.")
    unsupported = sorted(set(body) - BODY_KEYS - {"stream", "stream_options"})
    if unsupported:  # dropping them would silently change what is asked
        raise InvalidRequestError(
            f"'body' has keys callboard does not send: {unsupported} (supported: "
            f"{sorted(BODY_KEYS)})"
        )
    owned = {"messages", "stream", "stream_options"}
    fields: dict[str, Any] = {k: v for k, v in body.items() if k not in owned}
    if "messages" not in body:
        raise InvalidRequestError("'body' has no 'messages'")
    return Line(number, ident, _request(body["messages"], fields))


def _ident(value: object) -> str:
    """A line's id (it is the ledger's idempotency key, so as that key must be: not
    blank; an id of spaces passed here and stopped every run at its line)."""
    if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise InvalidRequestError(f"id must be a non-empty string or integer, got {value!r}")
    ident = str(value)
    if lone_surrogate(ident):  # JSON lets "\ud800" through
        raise InvalidRequestError(  # and no file or ledger can hold it: not Unicode text
            "id holds a lone surrogate (an escape from \\ud800 to \\udfff that is not half "
            "of a pair): an id must be Unicode text"
        )
    return ident


def _request(prompt: Any, fields: dict[str, Any]) -> Request:
    try:
        return Request.of(prompt, **fields)
    except TypeError as exc:  # a field of the wrong shape that dataclass init rejected
        raise InvalidRequestError(str(exc)) from exc


def result_record(
    ident: str,
    result: Result,
    *,
    digest: str | None = None,
    priced: bool = True,
    embedding: Embedding | None = None,
) -> dict[str, Any]:
    """The output line for one result. ``digest``: ``request_digest`` of the request it
    answers; ``priced``: False when the model has no price, so its cost is unknown
    (``cost_usd`` null, not "0"); ``embedding``: how the vectors of an embeddings line
    are written (its completed record carries ``embedding`` or ``embeddings`` instead
    of ``text``; an answer whose vectors cannot be used is written ``failed``,
    ``malformed_response``)."""
    record: dict[str, Any] = {
        "id": ident,
        "ok": result.ok,
        "status": type(result).__name__.lower(),
        "model": result.model,
        "attempts": result.attempts,
        "latency_s": round(result.latency_s, 4),
        "queue_wait_s": round(result.queue_wait_s, 4),
        "usage": {
            "prompt_tokens": result.usage.prompt_tokens,
            "completion_tokens": result.usage.completion_tokens,
            "cached_tokens": result.usage.cached_tokens,
            "reasoning_tokens": result.usage.reasoning_tokens,
            "cache_write_tokens": result.usage.cache_write_tokens,
            "cache_write_1h_tokens": result.usage.cache_write_1h_tokens,
        },
        # plain text: ``str`` wrote 2.9E-7 beside 0.008125 in one column (a hunt)
        "cost_usd": usd_text(result.cost_usd) if priced or result.model is None else None,
        "task_id": result.task_id,
    }
    if digest is not None:
        record["request_sha256"] = digest
    if result.request_id is not None:  # the provider's id of the call, for its support
        record["request_id"] = result.request_id
    if result.usage.estimated:  # the provider gave no usage: upper bounds, said so
        record["usage"]["estimated"] = True
    if isinstance(result, Completed) and embedding is not None:
        _vectors(record, result, embedding)
    elif isinstance(result, Completed):
        record.update(_answer(result))
    else:
        record["error"] = _error(result)
    if result.metadata:
        record["metadata"] = dict(result.metadata)
    return record


def _answer(result: Completed) -> dict[str, Any]:
    """A completion's fields of its line: its text and finish, and what else it has."""
    said: dict[str, Any] = {"text": result.content, "finish_reason": result.finish_reason}
    if result.tool_calls:
        said["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in result.tool_calls
        ]
    if result.refusal is not None:
        said["refusal"] = result.refusal
    if result.parsed is not None:
        said["parsed"] = result.parsed
    if result.reasoning is not None:  # paid for: it was left out (found by a hunt)
        said["reasoning"] = result.reasoning
    if result.thinking_blocks:
        said["thinking_blocks"] = [dict(b) for b in result.thinking_blocks]
    if result.choices:
        said["choices"] = [
            {"index": c.index, "text": c.content, "finish_reason": c.finish_reason}
            for c in result.choices
        ]
    return said


def _vectors(record: dict[str, Any], result: Completed, embedding: Embedding) -> None:
    """The vectors of an embeddings line's completed result into ``record``: as floats,
    or as base64 where the line asked for it; a failure if they cannot be used."""
    try:
        vectors, _ = ordered_vectors(
            result.raw,
            embedding.count,
            decode=not embedding.keep_base64,
            dimensions=embedding.dimensions,
        )
    except UnusableAnswerError as exc:
        record.update(ok=False, status="failed")
        record["error"] = {
            "type": "Failed",
            "reason": "malformed_response",
            "detail": f"the provider's answer cannot be used: {exc}",
        }
        return
    if embedding.single:
        record["embedding"] = vectors[0]
    else:
        record["embeddings"] = vectors


def _error(result: Result) -> dict[str, Any]:
    err: dict[str, Any] = {"type": type(result).__name__}
    if isinstance(result, Failed):
        err["reason"] = result.reason.value
        if result.status_code is not None:
            err["status_code"] = result.status_code
    elif isinstance(result, Rejected):
        err["reason"] = result.reason.value
    err["detail"] = getattr(result, "detail", "")
    return err


def error_record(error: LineError) -> dict[str, Any]:
    return {
        "id": error.id,
        "ok": False,
        "status": "invalid",
        "error": {"type": "InvalidRequest", "line": error.number, "detail": error.message},
    }


RECORD_STATUSES = frozenset({"completed", "failed", "expired", "rejected", "cancelled", "invalid"})


class NotOurOutputError(InvalidRequestError):
    """The output file holds lines that are not callboard result records."""


class DamagedOutputError(NotOurOutputError):
    """The output file is ours, but lines between its records are not records."""


@dataclass(slots=True)
class OutputState:
    """What an output file says about each id (for resuming)."""

    statuses: dict[str, str] = field(default_factory=dict)
    """The last status of each id with a result line (``cancelled`` lines left out)."""
    digests: dict[str, str] = field(default_factory=dict)
    """The ``request_sha256`` of each id's last result line, where it has one."""
    doubled: int = 0
    """Lines whose id has a line before them (a rewrite that keeps one line per id did
    not happen: a crash, a full disk): the next rewrite drops the earlier ones."""


def read_output(path: Path, *, first: int | None = None) -> OutputState:
    """What ``path`` holds for each id (for resuming).

    ``cancelled`` lines (written by older versions when interrupted) do not count:
    those ids run again. A torn last line is skipped (``repair_tail`` cuts it).
    Raises ``NotOurOutputError`` if no line is a result record (a file that is not ours
    is never appended to), ``DamagedOutputError`` naming the lines that are not records
    in a file that has some. ``first``: read only that many lines (a quick look before
    anything is created beside the file).
    """
    state = OutputState()
    if not path.exists():
        return state
    bad: list[int] = []
    records = 0
    ids: set[str] = set()
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            if first is not None and number > first:
                break
            if not raw.strip():
                continue
            obj = _record(raw)
            if obj is None:
                if not raw.endswith(b"\n"):
                    continue  # the last line, cut short by a crash: that id runs again
                bad.append(number)
                continue
            records += 1
            ident = str(obj["id"])
            if ident in ids:
                state.doubled += 1
            ids.add(ident)
            if obj["status"] != "cancelled":
                state.statuses[ident] = obj["status"]
                digest = obj.get("request_sha256")
                if isinstance(digest, str):
                    state.digests[ident] = digest
                else:
                    state.digests.pop(ident, None)
    if bad:
        _refuse(path, bad, ours=records > 0)
    return state


def is_record(raw: bytes) -> bool:
    """Whether ``raw`` (a line) is one of our result records."""
    return _record(raw) is not None


def _record(raw: bytes) -> dict[str, Any] | None:
    """The line as one of our records, or None."""
    try:
        obj = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8
        return None
    if isinstance(obj, dict) and "id" in obj and obj.get("status") in RECORD_STATUSES:
        return obj
    return None


def _refuse(path: Path, bad: list[int], *, ours: bool) -> None:
    if not ours:
        raise NotOurOutputError(
            f"{path}: line {bad[0]} is not a callboard result record; is this the right -o?"
        )
    lines = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise DamagedOutputError(
        f"{path} is damaged: line{'s' if len(bad) > 1 else ''} {lines} between its result "
        "records are not records (an edit, or a crash that left garbage). Remove those "
        "lines and run again: an id whose line is gone runs again"
    )


LINE_ID = re.compile(r"line-[1-9][0-9]*")
"""The id a line with no usable id of its own gets: ``line-N``."""


def stale_errors(statuses: Mapping[str, str], ids: Collection[str]) -> set[str]:
    """The error records for lines keyed by number (``line-N``) that no line of the
    input (``ids``) is keyed by any more: the line was fixed and has an id of its own
    now, or moved. Those records describe nothing left to fix."""
    return {
        i
        for i, status in statuses.items()
        if status == "invalid" and i not in ids and LINE_ID.fullmatch(i)
    }


def compact_output(path: Path, *, drop: Collection[str] = ()) -> None:
    """Rewrite ``path`` keeping the last line of each id (in first-seen order), and none
    for the ids in ``drop``. Atomic: a temporary file replaces it. Two passes: where each
    id's last line is, then those lines copied; only their places are held (holding
    the lines took the whole file into memory, a multi-GB embeddings output too; found
    by a hunt)."""
    path = path.resolve()  # through a symbolic link: the file it names is rewritten
    last: dict[str, tuple[int, int]] = {}
    """Each id's last line: (offset, length) in the file."""
    with path.open("rb") as fh:
        offset = 0
        for raw in fh:
            obj = _record(raw) if raw.strip() else None
            if obj is not None:  # a line torn by a failed write has no id: its id reruns
                last[str(obj["id"])] = (offset, len(raw))
            offset += len(raw)
    for ident in drop:
        last.pop(ident, None)
    tmp = path.with_name(path.name + ".compacting")
    was = path.stat()
    # a new file, never one that is there: a stale one (a rewrite killed midway) goes, and
    # a symbolic link planted there is neither followed nor left (it was opened through:
    # the file it named was overwritten, and the link renamed over the output; a hunt)
    tmp.unlink(missing_ok=True)
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
        stat.S_IMODE(was.st_mode),
    )
    try:
        with os.fdopen(fd, "wb") as fh, path.open("rb") as src:
            for offset, length in last.values():
                src.seek(offset)
                raw = src.read(length)
                fh.write(raw if raw.endswith(b"\n") else raw + b"\n")
            fh.flush()
            os.fchmod(fh.fileno(), stat.S_IMODE(was.st_mode))  # whatever the umask took
            with contextlib.suppress(PermissionError):  # only root may give it away
                os.fchown(fh.fileno(), was.st_uid, was.st_gid)
            os.fsync(fh.fileno())  # on disk before it takes the name: a power cut leaves
        tmp.replace(path)  # the old file or the new, never an empty one
        sync_folder(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)  # the file stays as it was, whole
        raise
