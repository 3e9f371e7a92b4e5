"""What a ``chat.completion`` answer holds for its caller: text, tool calls, refusal,
the JSON asked for, log probabilities and every choice.

Theory of operation
-------------------
The I/O loop hands the model actor the answer as a ``chat.completion`` object
(a dialect's answer translated to it: ``callboard.wire``). ``read_answer``
turns it into the fields of a ``Completed`` result for the request that asked:

* the first choice's ``content``, ``finish_reason``, ``tool_calls`` (id, name
  and the arguments' raw text), ``refusal`` and ``logprobs``; its ``reasoning``
  (``reasoning_content`` or ``reasoning``) and a Claude model's signed
  ``thinking_blocks``, which a tool loop sends back;
* ``choices``, every choice, when the request asked for ``n`` > 1;
* ``parsed``: the text as JSON when the request asked for a JSON response
  format. A strict ``json_schema`` whose answer does not parse is a failure
  (``MALFORMED_OUTPUT``, the call's cost charged), not an answer, unless the
  answer was cut short (``finish_reason`` ``length`` or ``content_filter``: an
  answer with nothing parsed, as any cut answer is); a refusal is an answer with
  ``refusal`` set and nothing parsed.

What must hold: pure; reads only what the answer holds (a field it lacks is
None or empty, never invented); never raises on an answer the loop accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from callboard.messages import Choice, FailureReason, FrozenMap, Request, ToolCall
from callboard.wire.openai import reasoning_of

__all__ = ["read_answer"]


def read_answer(answer: Mapping[str, Any] | None, request: Request) -> dict[str, Any]:
    """The ``Completed`` fields ``answer`` gives beyond ``content`` and ``finish_reason``,
    or ``{"reason": MALFORMED_OUTPUT, "detail": ...}`` for a strict JSON answer that is
    not JSON though it was not cut short."""
    if answer is None or _plain(answer, request):
        return {}
    return _read_choices(answer, request)


def _plain(answer: Mapping[str, Any], request: Request) -> bool:
    """One choice of text alone, for a request that asks no JSON: nothing beyond its
    content and finish reason (most answers; ``_read_choices`` built a ``Choice`` for it,
    2.9 us a call on the model actor's thread)."""
    choices = answer.get("choices")
    if type(choices) is not list or len(choices) != 1 or request.wants_json is not None:
        return False
    choice = choices[0]
    message = choice.get("message") if type(choice) is dict else None
    return (
        type(message) is dict
        and not message.get("tool_calls")
        and message.get("refusal") is None
        and choice.get("logprobs") is None
        and not reasoning_of(message)
        and not message.get("thinking_blocks")
    )


def _read_choices(answer: Mapping[str, Any], request: Request) -> dict[str, Any]:
    """``read_answer`` of any answer, every choice read."""
    choices = [_choice(c, i) for i, c in enumerate(answer.get("choices") or ())]
    if not choices:
        return {}
    first = choices[0]
    fields: dict[str, Any] = {}
    if first.tool_calls:
        fields["tool_calls"] = first.tool_calls
    if first.refusal is not None:
        fields["refusal"] = first.refusal
    if first.logprobs is not None:
        fields["logprobs"] = first.logprobs
    fields.update(_thought(answer.get("choices")))
    if len(choices) > 1:
        fields["choices"] = tuple(choices)
    if request.wants_json is not None and first.refusal is None and not first.tool_calls:
        try:
            fields["parsed"] = json.loads(first.content or "")
        except (ValueError, RecursionError) as exc:  # nested past the parser's depth: it
            # killed the model actor judging it, twice, and the call was sent twice (a hunt)
            if request.strict_json and first.finish_reason not in _CUT:
                said = f"a strict json_schema was asked and the answer is not JSON: {exc}"
                return {"reason": FailureReason.MALFORMED_OUTPUT, "detail": said}
    return fields


def _thought(choices: Any) -> dict[str, Any]:
    """The first choice's reasoning and signed thinking blocks (a Claude model's),
    where its message says them."""
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        return {}
    fields: dict[str, Any] = {}
    reasoning = reasoning_of(message)
    if isinstance(reasoning, str) and reasoning:
        fields["reasoning"] = reasoning
    blocks = message.get("thinking_blocks")
    if isinstance(blocks, list) and blocks:
        fields["thinking_blocks"] = tuple(FrozenMap(b) for b in blocks if isinstance(b, dict))
    return fields


_CUT = frozenset({"length", "content_filter"})
"""Finish reasons that cut an answer short: the answer as the provider gave it, its
``finish_reason`` saying why nothing is parsed (the SDKs raise
``LengthFinishReasonError`` / ``ContentFilterFinishReasonError`` from it). A failure
(``MALFORMED_OUTPUT``) lost the paid completion, and a gateway turned it into a 502
where OpenAI's API answers the completion (found by a hunt)."""


def _choice(choice: Any, index: int) -> Choice:
    if type(choice) is not dict and not isinstance(choice, Mapping):
        return Choice(index=index, content=None)
    message = choice.get("message")
    message = message if type(message) is dict or isinstance(message, Mapping) else {}
    content = message.get("content")
    refusal = message.get("refusal")
    logprobs = choice.get("logprobs")
    return Choice(
        index=choice.get("index", index) if isinstance(choice.get("index"), int) else index,
        content=content if isinstance(content, str) else None,
        tool_calls=_tool_calls(message.get("tool_calls")),
        finish_reason=_text_or_none(choice.get("finish_reason")),
        refusal=refusal if isinstance(refusal, str) else None,
        logprobs=logprobs if isinstance(logprobs, Mapping) else None,
    )


def _tool_calls(calls: Any) -> tuple[ToolCall, ...]:
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        return ()
    found = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            continue
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):  # some servers send the object itself
            arguments = json.dumps(arguments, separators=(",", ":"))
        found.append(
            ToolCall(
                id=str(call.get("id") or ""),
                name=str(fn.get("name") or ""),
                arguments=arguments,
            )
        )
    return tuple(found)


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
