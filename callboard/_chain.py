"""Chains: stages run in turn, each fed the previous stage's text.

``chained`` is the pattern, once (see ``_futures``): ``chain`` waits on it
blocking, ``achain`` awaits it (and awaits a stage that is ``async``).

What must hold:

* Every task of a chain carries one ``trace_id``; a stage may not set its own.
* The chain stops at the first result that is not ok: failures are results
  (``ChainResult.ok`` is False, ``failed_stage`` says where), never exceptions.
* Stages are checked before anything is sent; a stage that produces
  something other than a prompt, a ``Request`` or a dict of fields raises a
  ``UsageError``, as does a first stage whose request is invalid; a later
  stage's invalid request (the text before it empty: a tool call, a stage
  function returning "") ends the chain ``Failed(REQUEST_ERROR)`` there, the
  stages run kept with their results (they were paid for).
"""

from __future__ import annotations

import dataclasses
import inspect
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from callboard._futures import Steps, await_steps, wait_steps
from callboard._submitter import (
    NO_PROMPT,
    Face,
    checked_fields,
    checked_trace_id,
    new_trace_id,
    request_of,
    submitter_of,
)
from callboard.messages import (
    Failed,
    FailureReason,
    InvalidRequestError,
    QueueFullError,
    Rejected,
    RejectReason,
    Request,
    Result,
    SystemStoppedError,
    UnavailableError,
    UnknownModelError,
    UsageError,
)
from callboard.messages._results import NANO

Stage = str | Callable[[str], object]
"""A chain stage: a template naming ``{input}``, or a function of the previous text
returning a prompt, a ``Request`` or a dict of request fields (``prompt`` or
``messages`` plus fields); in ``achain`` it may be ``async``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainResult:
    """What a chain came to: one result per stage run, the last being the answer or the failure."""

    results: tuple[Result, ...]
    trace_id: str
    stages: int

    @property
    def result(self) -> Result:
        return self.results[-1]

    @property
    def ok(self) -> bool:
        return len(self.results) == self.stages and self.result.ok

    @property
    def text(self) -> str | None:
        return self.result.text

    @property
    def failed_stage(self) -> int | None:
        """The index of the stage that failed, or None."""
        return None if self.ok else len(self.results) - 1

    @property
    def cost_nusd(self) -> int:
        return sum(r.cost_nusd for r in self.results)

    @property
    def cost_usd(self) -> Decimal:
        return Decimal(self.cost_nusd) / NANO


def _refused(exc: Exception, trace_id: str) -> Rejected:
    """The result of a stage the system refused to take (stopping, full): a failure of
    the chain, never an exception losing the stages that ran (task id 0: none given)."""
    reason = RejectReason.QUEUE_FULL if isinstance(exc, QueueFullError) else RejectReason.STOPPING
    return Rejected(task_id=0, trace_id=trace_id, reason=reason, detail=str(exc))


def _check_stages(stages: Sequence[Stage]) -> None:
    if isinstance(stages, str) or not stages:
        raise UsageError("chain needs a non-empty list of stages")
    for i, stage in enumerate(stages):
        if callable(stage):
            continue
        if not isinstance(stage, str):
            raise UsageError(f"stage {i} must be a template string or a callable, got {stage!r}")
        try:
            fields = [f for f in string.Formatter().parse(stage) if f[1] is not None]
        except ValueError as exc:  # "{" alone, "}{input}"
            raise UsageError(f"stage {i} template {stage!r} does not parse: {exc}") from None
        names = {name for _, name, _, _ in fields if name is not None}
        if names - {"input"}:
            raise UsageError(f"stage {i} template may only name {{input}}, not {sorted(names)}")
        if any(spec or conversion for _, _, spec, conversion in fields):  # "{input!z}" failed
            raise UsageError(f"stage {i} template: {{input}} takes no conversion or format spec")


def _stage_request(output: object, fields: Mapping[str, Any], index: int) -> Request:
    """Turn what a stage produced (a prompt, a Request or a dict of fields) into a Request.

    The chain's fields apply to every stage: a stage's Request takes them too (its
    own other fields kept), a stage's dict may override them. An idempotency key
    becomes one per stage (``key:index``), or the stages would refuse each other.
    """
    key = fields.get("idempotency_key")
    if key is not None:
        fields = {**fields, "idempotency_key": f"{key}:{index}"}
    if isinstance(output, Request):
        own = {"model": output.model, "route": output.route}
        return dataclasses.replace(output, **_under(fields, own)) if fields else output
    if isinstance(output, str):
        return Request.of(output, **fields)
    if isinstance(output, Mapping):
        spec = dict(output)
        if "trace_id" in spec:
            raise UsageError(f"stage {index}: the chain owns trace_id; do not set it per stage")
        checked_fields(spec, f"stage {index}'s dict", ("prompt", "messages"))
        return request_of(NO_PROMPT, {**_under(fields, spec), **spec})
    raise UsageError(f"stage {index} returned {type(output).__name__}: want str, Request or dict")


def _under(fields: Mapping[str, Any], own: Mapping[str, Any]) -> Mapping[str, Any]:
    """The chain's ``fields`` under a stage's ``own``: a stage that names its model (or
    route) drops the chain's route (or model), as its own target overrides the chain's;
    with both, the request was refused (``one_target``) mid-chain, its first stages
    paid for (found by a review)."""
    if own.get("model") is not None and fields.get("route") is not None:
        return {k: v for k, v in fields.items() if k != "route"}
    if own.get("route") is not None and fields.get("model") is not None:
        return {k: v for k, v in fields.items() if k != "model"}
    return fields


def _stage_output(stage: Stage, text: str) -> object:
    return stage.format(input=text) if isinstance(stage, str) else stage(text)


def chained(
    face: Face,
    given: Iterable[Stage],
    first_input: str,
    trace_id: str | None,
    fields: Mapping[str, Any],
) -> Steps[ChainResult]:
    """Run ``stages`` in turn under one trace id; stop at the first result that is not ok.

    A stage that returns an awaitable yields it (to be awaited: ``achain`` only)."""
    submitter = submitter_of(face)
    # a generator was read up by the check, and then ran no stage
    stages = given if isinstance(given, str | Sequence) else tuple(given)
    _check_stages(stages)
    if not isinstance(first_input, str):  # None was sent as the prompt "None"
        raise UsageError(f"chain's first input must be a string, got {first_input!r}")
    checked_fields(fields, "chain")
    trace = checked_trace_id(trace_id) or new_trace_id("chain")
    results: list[Result] = []
    text = first_input
    for i, stage in enumerate(stages):
        output = _stage_output(stage, text)
        if inspect.isawaitable(output):
            output = yield output
        try:
            submitted = submitter.submit(_stage_request(output, fields, i), trace_id=trace)
        except (InvalidRequestError, UnknownModelError) as exc:  # a stage's text was empty,
            said = f"stage {i}: {exc}"  # or its fields bad, or its model unknown
            if not results:
                raise type(exc)(said) from None
            results.append(  # a failure of the chain: the stages that ran keep their results
                Failed(task_id=0, trace_id=trace, reason=FailureReason.REQUEST_ERROR, detail=said)
            )
            break
        except (SystemStoppedError, UnavailableError, QueueFullError) as exc:
            if not results:
                raise  # nothing run yet: as a submit would
            results.append(_refused(exc, trace))  # the stages run keep their results
            break
        result: Result = yield submitted
        results.append(result)
        if not result.ok:
            break
        text = result.text or ""
    return ChainResult(results=tuple(results), trace_id=trace, stages=len(stages))


def chain(
    face: Face,
    stages: Sequence[Stage],
    first_input: str,
    /,
    *,
    trace_id: str | None = None,
    **fields: Any,
) -> ChainResult:
    """Run ``stages`` in turn, each fed the previous stage's text; stop at the first failure.

    ``fields`` apply to every stage (a stage's dict may override them); every
    task carries one ``trace_id``. An ``async`` stage needs ``achain``.
    """
    return wait_steps(chained(face, stages, first_input, trace_id, fields))


async def achain(
    face: Face,
    stages: Sequence[Stage],
    first_input: str,
    /,
    *,
    trace_id: str | None = None,
    **fields: Any,
) -> ChainResult:
    """``chain`` for asyncio; a stage function may be ``async``."""
    return await await_steps(chained(face, stages, first_input, trace_id, fields))
