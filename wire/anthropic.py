"""Anthropic's Messages API as a dialect of the chat wire, sans-IO.

Theory of operation
-------------------
callboard speaks one wire inside: OpenAI's Chat Completions request body and
``chat.completion`` answer. A model whose ``api`` is ``anthropic`` translates
at its edge, with three pure functions:

* ``request_body(chat)``: a Chat Completions body to a Messages body. System
  and developer turns become ``system``; a user's content parts become
  content blocks (an ``image_url`` as a ``base64`` or ``url`` image source);
  an assistant's ``tool_calls`` become ``tool_use`` blocks (their JSON
  ``arguments`` parsed to ``input``); ``tool`` turns become ``tool_result``
  blocks in one user turn; neighbouring turns of one role are merged (the
  API wants them alternating). ``max_completion_tokens`` or ``max_tokens``
  becomes the required ``max_tokens``, ``stop`` ``stop_sequences``, ``user``
  ``metadata.user_id``, ``tools`` ``input_schema`` tools and ``tool_choice``
  (``required`` is ``any``; ``parallel_tool_calls: false`` is
  ``disable_parallel_tool_use``). A tool call id of characters Anthropic refuses
  (an OpenAI-compatible server's ``functions.get_weather:0``) is written with
  them replaced and a digest of the whole beside (``_tool_id``: the same on the
  ``tool_use`` and its ``tool_result``); a ``cache_control`` mark on a content
  part, a tool result's part or a tool goes on its block; an empty text part is
  left out (the API refuses one), and a user turn with nothing else is refused,
  as is a stop sequence of white space alone. A ``json_schema`` response format is asked
  for the way Anthropic's tool-use guide does it: one tool, named for the
  schema, whose ``input_schema`` is the schema, forced by ``tool_choice``
  (beside the caller's own tools: ``any`` of them for ``auto``, the named one
  for a named choice; ``required`` cannot be said and is refused);
  ``completion`` turns its input back into the answer's text. A field the
  Messages API cannot honour (``n`` > 1, ``logprobs``, ``seed``,
  ``logit_bias``, penalties, ``json_object``) is an ``InvalidRequestError``
  naming it, never dropped in silence; ``extra_body`` is merged as is.
* ``completion(message, *, json_tool)``: a Messages answer to a
  ``chat.completion``: text blocks joined into ``content``, ``tool_use``
  blocks into ``tool_calls`` (``input`` dumped to ``arguments``),
  ``stop_reason`` to ``finish_reason`` (``end_turn``/``stop_sequence``:
  ``stop``; ``max_tokens`` and a full context window: ``length``;
  ``tool_use``: ``tool_calls``; ``refusal``: ``content_filter``;
  ``pause_turn`` stays ``pause_turn``: the turn is not over, the caller sends
  the answer back to let it go on, and no OpenAI reason says that),
  usage with the cache's reads and writes counted in ``prompt_tokens`` (they
  are input), the reads as ``cached_tokens`` and the writes as
  ``cache_write_tokens`` (each priced apart).
* ``StreamAssembler``: Messages stream events (``message_start``,
  ``content_block_start``/``_delta``/``_stop``, ``message_delta``,
  ``message_stop``, ``ping``, ``error``) to ``chat.completion.chunk`` deltas,
  and at the end the same ``chat.completion`` ``completion`` gives.

The way back, for the gateway's ``POST /v1/messages`` (callboard answering an
Anthropic client): ``stop_reason_of`` and ``message_usage`` invert the stop
reason and usage mappings above, so each pair lives in one place.

What must hold: the translation loses nothing the caller asked for (what it
cannot carry is refused by name); tool call ids survive the round trip both
ways, so a conversation can move between an OpenAI and a Claude model; an
answer's ``content`` is None exactly when it has no text. Pure: no I/O, no
clock; bodies come in as parsed JSON.

Found by a hunt: ids of other characters went as they were and Anthropic refused
the call (400), as it did a stop sequence of ``"\n"`` and an empty text; caching
marks were dropped in silence.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from callboard.messages import THINKING_BLOCK_TYPES, InvalidRequestError
from callboard.wire.openai import FIELDS

__all__ = [
    "ANTHROPIC_VERSION",
    "FINISH_REASONS",
    "MAX_TEMPERATURE",
    "STOP_REASONS",
    "StreamAssembler",
    "completion",
    "headers",
    "json_tool_of",
    "message_usage",
    "request_body",
    "stop_reason_of",
    "thinking_block",
    "usage",
]

ANTHROPIC_VERSION = "2023-06-01"
"""The ``anthropic-version`` header every request carries."""

MAX_TEMPERATURE = 1
"""The Messages API takes a temperature from 0 to this (Chat Completions: to 2)."""
FINISH_REASONS: Mapping[str, str] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "pause_turn",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
"""Anthropic's ``stop_reason`` as OpenAI's ``finish_reason``."""

STOP_REASONS: Mapping[str, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
    "pause_turn": "pause_turn",
}
"""OpenAI's ``finish_reason`` as Anthropic's ``stop_reason``: the way back, for an
answer given in Anthropic's shape (OpenAI's ``stop`` does not say whether a stop
sequence ended the answer, so it is ``end_turn``)."""

_UNSUPPORTED: dict[str, object] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "logprobs": False,
    "top_logprobs": 0,
    "seed": None,
}
"""Chat fields the Messages API has no way to honour, each with the value that asks
for nothing (a seed has none: ``seed=0`` is a seed)."""
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+);base64,(?P<data>.*)", re.DOTALL)


def headers(api_key: str) -> dict[str, str]:
    """The headers a Messages request carries (the key in ``x-api-key``)."""
    return {"x-api-key": api_key, "anthropic-version": ANTHROPIC_VERSION}


def json_tool_of(chat: Mapping[str, Any]) -> str | None:
    """The tool a ``json_schema`` response format is asked through, if the body has one."""
    fmt = chat.get("response_format")
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        return None
    schema = fmt.get("json_schema")
    name = schema.get("name") if isinstance(schema, Mapping) else None
    return name if isinstance(name, str) and name else "json_answer"


def request_body(chat: Mapping[str, Any]) -> dict[str, Any]:  # noqa: PLR0912, PLR0915 - a field each
    """A Chat Completions body as a Messages body (see the module docstring)."""
    for name, nothing in _UNSUPPORTED.items():
        value = chat.get(name)
        if value is not None and value != nothing:
            raise _refused(name, "the Messages API has no such parameter")
    if chat.get("n", 1) != 1:
        raise _refused("n", "the Messages API answers one choice per request")
    system, turns = _turns(chat.get("messages"))
    if not turns:  # sent, an empty list is answered 400 (a hunt)
        raise _refused("messages", "the Messages API takes no chat without a user turn")
    body: dict[str, Any] = {"model": chat.get("model"), "messages": turns}
    max_tokens = chat.get("max_completion_tokens", chat.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _refused("max_tokens", "the Messages API needs max_tokens, an integer >= 1")
    body["max_tokens"] = max_tokens
    if system:
        body["system"] = system
    temperature = chat.get("temperature")
    if isinstance(temperature, int | float) and temperature > MAX_TEMPERATURE:
        raise _refused(
            "temperature", f"the Messages API takes 0..{MAX_TEMPERATURE}, got {temperature!r}"
        )
    for same in ("temperature", "top_p", "thinking"):
        if chat.get(same) is not None:
            body[same] = chat[same]
    stop = chat.get("stop")
    if stop is not None:
        body["stop_sequences"] = _stop_sequences(stop)
    if chat.get("user") is not None:
        body["metadata"] = {"user_id": chat["user"]}
    if chat.get("stream"):
        body["stream"] = True
    tools = [_tool(t, i) for i, t in enumerate(chat.get("tools") or ())]
    choice = _tool_choice(chat.get("tool_choice"), chat.get("parallel_tool_calls"))
    fmt = chat.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_object":
        raise _refused(
            "response_format", "json_object has no Messages equivalent: give a json_schema"
        )
    json_tool = json_tool_of(chat)
    if json_tool is not None:
        choice = _json_choice(chat, json_tool, own_tools=bool(tools))
        schema = fmt["json_schema"] if isinstance(fmt, Mapping) else {}
        answer_tool: dict[str, Any] = {
            "name": json_tool,
            "description": schema.get("description") or "Answer with this JSON object.",
            "input_schema": schema.get("schema") or {"type": "object"},
        }
        if schema.get("strict") is not None:  # strict tool use: the input matches it
            answer_tool["strict"] = schema["strict"]
        tools.append(answer_tool)
    if tools:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    # stream_options, service_tier and reasoning_effort have no Messages equivalent and
    # change nothing a caller can see: known, and left out
    unknown = set(chat) - FIELDS
    if unknown:
        raise _refused(min(unknown), "not a Chat Completions field callboard knows")
    extra = chat.get("extra_body")
    if isinstance(extra, Mapping):
        _merge(body, extra)
    return body


def _merge(body: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """``extra``'s fields into ``body``, at its top level; a ``metadata`` there beside
    the one ``user`` made is one metadata of both (merged over it, the end user's id
    was lost; found by a hunt)."""
    said = body.get("metadata")
    body.update(extra)
    given = extra.get("metadata")
    if said is not None and isinstance(given, Mapping):
        body["metadata"] = {**said, **given}


_UNCARRIED_IN_TURNS = {
    "name": "the Messages API has no participants' names",
    "audio": "the Messages API has no audio",
}
"""A turn's fields the Messages API cannot carry, and why."""


def _check_carried(m: Mapping[str, Any], i: int) -> None:
    for field, why in _UNCARRIED_IN_TURNS.items():
        if m.get(field) is not None:
            raise _refused(f"messages[{i}].{field}", why)


def _refused(field: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {why} (model api = 'anthropic')")


def _turns(messages: object) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]]]:
    """(system, alternating turns) from Chat Completions messages: the system text (its
    messages joined by a blank line), or its text blocks when one came in parts."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise _refused("messages", "must be a list of messages")
    system: list[str | list[dict[str, Any]]] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise _refused(f"messages[{i}]", "must be an object")
        _check_carried(m, i)
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text_only(m.get("content"), f"messages[{i}].content"))
            continue
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": _tool_id(m.get("tool_call_id")),
                "content": _text_only(m.get("content"), f"messages[{i}].content"),
            }
            _append(turns, "user", [block])
        elif role == "user":
            blocks = _blocks(m.get("content"), f"messages[{i}].content")
            if not blocks:
                raise _refused(f"messages[{i}].content", "the Messages API takes no empty turn")
            _append(turns, "user", blocks)
        elif role == "assistant":
            blocks = _assistant_blocks(m, i)
            if blocks:
                _append(turns, "assistant", blocks)
            elif i < len(messages) - 1:  # an empty last turn asks for nothing: left out
                raise _refused(
                    f"messages[{i}]",
                    "an assistant turn with no content, refusal or tool_calls: the "
                    "Messages API takes no empty turn but the last",
                )
        else:
            raise _refused(f"messages[{i}].role", f"{role!r} is not a chat role")
    if all(isinstance(s, str) for s in system):
        return "\n\n".join(s for s in system if isinstance(s, str)), turns
    blocks = [
        b for s in system for b in ([{"type": "text", "text": s}] if isinstance(s, str) else s)
    ]
    return blocks, turns


def _assistant_blocks(m: Mapping[str, Any], i: int) -> list[dict[str, Any]]:
    """An assistant turn's blocks: its thinking (signed, as the model gave it), its
    content (or, when it said nothing else, its refusal, as the text it was), then its
    tool calls."""
    blocks = [thinking_block(b) for b in m.get("thinking_blocks") or ()]
    if m.get("content"):
        blocks += _blocks(m.get("content"), f"messages[{i}].content")
    refusal = m.get("refusal")
    if refusal and not any(b["type"] == "text" for b in blocks):
        blocks.append({"type": "text", "text": str(refusal)})
    for call in m.get("tool_calls") or ():
        blocks.append(_tool_use(call, f"messages[{i}].tool_calls"))
    return blocks


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    """Add ``blocks`` as a turn of ``role``, merged into the last turn if it has that role."""
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": list(blocks)})


def _text_only(content: object, where: str) -> str | list[dict[str, Any]]:
    """A text, or its parts as text blocks (as they came: several blocks are not one
    text glued together)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(
        isinstance(p, Mapping) and p.get("type") == "text" for p in content
    ):
        return [
            _marked({"type": "text", "text": str(p.get("text", ""))}, p)
            for p in content
            if p.get("text")
        ]
    raise _refused(where, "must be text here")


def _blocks(content: object, where: str) -> list[dict[str, Any]]:
    """A message's content as Messages content blocks (an empty text left out)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if not isinstance(content, Sequence):
        raise _refused(where, "must be a string or a list of content parts")
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            if part["text"]:
                blocks.append(_marked({"type": "text", "text": part["text"]}, part))
        elif kind == "image_url":
            blocks.append(_marked(_image(part.get("image_url"), f"{where}[{j}]"), part))
        else:
            raise _refused(f"{where}[{j}]", f"a {kind!r} part has no Messages equivalent")
    return blocks


def _stop_sequences(stop: object) -> list[Any]:
    sequences = [stop] if isinstance(stop, str) else list(stop)  # type: ignore[call-overload]
    if not all(isinstance(q, str) and q.strip() for q in sequences):
        raise _refused("stop", "the Messages API takes stop sequences of more than white space")
    return sequences


def _marked(block: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``block`` with the ``cache_control`` mark ``given`` carries, if any."""
    mark = given.get("cache_control")
    if mark is not None:
        block["cache_control"] = mark
    return block


_TOOL_ID = re.compile(r"[A-Za-z0-9_-]+")
"""What Anthropic takes in a ``tool_use`` id."""


def _tool_id(given: object) -> object:
    """A tool call id Anthropic takes: as given if it can, else its other characters
    replaced and a digest of the whole added (two ids that differ only there stay two)."""
    if not isinstance(given, str) or _TOOL_ID.fullmatch(given):
        return given
    digest = hashlib.sha256(given.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', given)}_{digest}"


def _image(spec: object, where: str) -> dict[str, Any]:
    url = spec.get("url") if isinstance(spec, Mapping) else None
    if not isinstance(url, str):
        raise _refused(where, "an image_url part needs a url")
    data = _DATA_URL.fullmatch(url)
    if data is not None:
        source = {"type": "base64", "media_type": data["type"], "data": data["data"]}
    elif url.startswith(("https://", "http://")):
        source = {"type": "url", "url": url}
    else:
        raise _refused(where, "an image url must be https:// or a base64 data: URL")
    return {"type": "image", "source": source}


def _tool_use(call: object, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or not isinstance(fn, Mapping):
        raise _refused(where, "a tool call needs a function")
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = None
    if not isinstance(arguments, dict):  # "[1]" or "5" went, for Anthropic's own 400 (a hunt)
        raise _refused(where, "a tool call's arguments must be a JSON object")
    tool_id = _tool_id(call.get("id"))
    return {"type": "tool_use", "id": tool_id, "name": fn.get("name"), "input": arguments}


def _tool(tool: object, i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if (
        not isinstance(tool, Mapping)
        or tool.get("type") != "function"
        or not isinstance(fn, Mapping)
    ):
        raise _refused(f"tools[{i}]", "must be a function tool")
    out: dict[str, Any] = {
        "name": fn.get("name"),
        "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
    }
    if fn.get("description"):
        out["description"] = fn["description"]
    if fn.get("strict") is not None:  # Anthropic's strict tool use, as OpenAI's strict
        out["strict"] = fn["strict"]  # (it was dropped: inputs went unchecked; a hunt)
    return _marked(out, tool)


def _tool_choice(choice: object, parallel: object) -> dict[str, Any] | None:
    if choice is None and parallel is None:
        return None
    if choice is None or choice == "auto":
        out: dict[str, Any] = {"type": "auto"}
    elif choice == "required":
        out = {"type": "any"}
    elif choice == "none":
        out = {"type": "none"}
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        out = {"type": "tool", "name": choice["function"].get("name")}
    else:
        raise _refused("tool_choice", "must be auto, required, none or a named function")
    if parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


def _json_choice(chat: Mapping[str, Any], json_tool: str, *, own_tools: bool) -> dict[str, Any]:
    """The ``tool_choice`` of a ``json_schema`` answer asked through the tool
    ``json_tool``, beside the caller's own tools and ``tool_choice``: with no tools of
    the caller's, or ``none``, the answer's tool, forced; ``auto`` (or none given):
    ``any`` tool, the caller's or the answer's (as OpenAI lets the model call a tool
    or answer in the schema); a named function: that one. ``required`` cannot be
    said (``any`` would let the model answer instead of calling) and is refused."""
    given = chat.get("tool_choice")
    parallel = chat.get("parallel_tool_calls")
    if given == "required":
        raise _refused(
            "tool_choice",
            "'required' with a json_schema response_format cannot be said: the schema is "
            "asked as a tool, and a forced call could be that tool instead of yours",
        )
    if isinstance(given, Mapping):
        named = _tool_choice(given, parallel)
        assert named is not None  # a named function was given
        return named
    out: dict[str, Any] = (
        {"type": "any"}
        if own_tools and given in (None, "auto")
        else {"type": "tool", "name": json_tool}
    )
    if parallel is False:
        out["disable_parallel_tool_use"] = True
    return out


# -- answers --------------------------------------------------------------------------------


def completion(message: Mapping[str, Any], *, json_tool: str | None = None) -> dict[str, Any]:
    """A Messages answer as a ``chat.completion`` (see the module docstring).
    ``json_tool``: the tool a ``json_schema`` format was asked through (its input is
    the answer's text, and the answer's finish is ``stop``)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[dict[str, Any]] = []
    for block in message.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind in THINKING_BLOCK_TYPES:
            thinking.append(thinking_block(block))
        elif kind == "tool_use" and json_tool is not None and block.get("name") == json_tool:
            given = block.get("input", {})  # a stream's is the text it carried
            texts.append(
                given if isinstance(given, str) else json.dumps(given, separators=(",", ":"))
            )
        elif kind == "tool_use":
            calls.append(_tool_call(block.get("id"), block.get("name"), block.get("input", {})))
    finish = _finish(message.get("stop_reason"), json_tool is not None and not calls)
    completed = _chat_completion(message, "".join(texts) if texts else None, calls, finish)
    if thinking:
        answer = completed["choices"][0]["message"]
        answer["reasoning_content"] = "".join(b.get("thinking", "") for b in thinking)
        answer["thinking_blocks"] = thinking
    return completed


def thinking_block(block: Mapping[str, Any]) -> dict[str, Any]:
    """A thinking block as the API answered it and a turn sends it back (LiteLLM's
    ``thinking_blocks``): its text and signature, or a redacted block's data, nothing
    else."""
    if block.get("type") == "redacted_thinking":
        return {"type": "redacted_thinking", "data": block.get("data", "")}
    return {
        "type": "thinking",
        "thinking": block.get("thinking", ""),
        "signature": block.get("signature", ""),
    }


def _finish(stop_reason: object, json_answer: bool) -> str | None:
    if stop_reason is None:
        return None
    if stop_reason == "tool_use" and json_answer:
        return "stop"
    return FINISH_REASONS.get(str(stop_reason), str(stop_reason))  # a new one as said


def _tool_call(call_id: object, name: object, arguments: object) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, separators=(",", ":"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _chat_completion(
    message: Mapping[str, Any], content: str | None, calls: list[dict[str, Any]], finish: str | None
) -> dict[str, Any]:
    answer: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        answer["tool_calls"] = calls
    if message.get("stop_reason") == "refusal":  # the text so far stays the content's
        answer["refusal"] = REFUSED
    choice: dict[str, Any] = {"index": 0, "message": answer, "finish_reason": finish}
    reason, said = message.get("stop_reason"), message.get("stop_sequence")
    if reason in FINISH_REASONS:  # the provider's own, which the finish reason may blur
        choice["stop_reason"] = reason  # (a context window's end is "length" too): the
    if reason == "stop_sequence" and isinstance(said, str):  # gateway's way back says it
        choice["stop_sequence"] = said  # and which sequence ended it
    completed = {
        "id": message.get("id"),
        "object": "chat.completion",
        "model": message.get("model"),
        "choices": [choice],
        "usage": usage(message.get("usage")),
    }
    said_usage = message.get("usage")
    tier = said_usage.get("service_tier") if isinstance(said_usage, Mapping) else None
    if isinstance(tier, str):  # where OpenAI's answer says it, for the price of that tier
        completed["service_tier"] = tier  # (Anthropic's is in its usage: a call served at
    return completed  # its priority tier was charged the standard price; found by a hunt)


REFUSED = "the provider stopped the answer for safety (stop_reason: refusal)"
"""An Anthropic refusal's ``refusal``: the stop says no more than that (it was the text
said before it, which then came twice, as the content and as the refusal)."""


def stop_reason_of(finish: str | None) -> str:
    """The ``stop_reason`` of an answer whose ``finish_reason`` is ``finish`` (None, or
    one OpenAI may add later: ``end_turn``)."""
    return STOP_REASONS.get(finish or "stop", "end_turn")


def message_usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    cache_write_tokens: int = 0,
    cache_write_1h_tokens: int = 0,
) -> dict[str, Any]:
    """Chat usage as Messages usage, the way back from ``usage``: the cache's reads and
    writes are not ``input_tokens`` there, and writes to the 1-hour cache are told
    apart in ``cache_creation`` when there are any."""
    back: dict[str, Any] = {
        "input_tokens": max(0, prompt_tokens - cached_tokens - cache_write_tokens),
        "output_tokens": completion_tokens,
        "cache_creation_input_tokens": cache_write_tokens,
        "cache_read_input_tokens": cached_tokens,
    }
    if cache_write_1h_tokens:
        back["cache_creation"] = {
            "ephemeral_5m_input_tokens": cache_write_tokens - cache_write_1h_tokens,
            "ephemeral_1h_input_tokens": cache_write_1h_tokens,
        }
    return back


def usage(u: object) -> dict[str, Any] | None:
    """Messages usage as chat usage: cache reads and writes are input tokens too, told
    apart in ``prompt_tokens_details`` (``cache_write_tokens``, as OpenRouter's usage
    names them), for each has a price of its own. None without ``input_tokens`` and
    ``output_tokens`` (the call is then charged its estimate, as an OpenAI answer
    without counts is). Counts are not judged here: one that is not a whole number
    >= 0 is passed on as it came, in the place it is summed into, for the reader of
    chat usage to refuse (summed, a negative ``input_tokens`` and a cache read would
    make a prompt that looks right)."""
    if (
        not isinstance(u, Mapping)
        or u.get("input_tokens") is None
        or u.get("output_tokens") is None
    ):
        return None
    read = u.get("cache_read_input_tokens") or 0
    written = u.get("cache_creation_input_tokens") or 0
    split = u.get("cache_creation")
    kept = split.get("ephemeral_1h_input_tokens") or 0 if isinstance(split, Mapping) else 0
    prompt = _sum(u["input_tokens"], read, written)
    out = u["output_tokens"]
    details = {"cached_tokens": read, "cache_write_tokens": written}
    if kept:
        details["cache_write_1h_tokens"] = kept
    return {
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "total_tokens": _sum(prompt, out),
        "prompt_tokens_details": details,
    }


def _sum(*counts: object) -> object:
    """The sum of whole counts >= 0 (``12.0`` is one), or the first that is not one,
    as it came."""
    total = 0
    for count in counts:
        if type(count) is float and count.is_integer() and count >= 0:
            total += int(count)
        elif type(count) is int and count >= 0:
            total += count
        else:
            return count
    return total


# -- streams --------------------------------------------------------------------------------


class StreamAssembler:
    """Messages stream events in, ``chat.completion.chunk`` objects out; ``completion()``
    at the end is the whole answer, as ``completion`` would give it for the message
    the events built. An ``error`` event raises ``StreamError``."""

    def __init__(self, *, json_tool: str | None = None) -> None:
        self._json_tool = json_tool
        self._message: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._texts: dict[int, list[str]] = {}
        """A text or thinking block's text as it arrives, in pieces (``_pieces``)."""
        self._partial: dict[int, list[str]] = {}
        """A tool_use block's input as it arrives, in JSON fragments."""
        self._calls: dict[int, int] = {}
        """Content block index -> its tool call's index among the answer's calls."""
        self._usage: dict[str, Any] = {}
        self.done = False
        """``message_stop`` came: the stream's last event."""
        self.stopped = False
        """A ``message_delta`` said why the message stopped: every block and the usage
        came before it (a stream that ends there, without ``message_stop``, is whole,
        as the ``anthropic`` SDK reads it)."""
        self.thinking = False
        """The model has sent thinking: the stream is under way though no text came yet
        (never the answer's text: the reader gets none of it)."""

    def feed(self, event: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks one event makes (none for most bookkeeping events)."""
        kind = event.get("type")
        if kind == "message_start":
            self._message = dict(event.get("message") or {})
            self._usage = dict(self._message.get("usage") or {})
            yield self._chunk({"role": "assistant", "content": ""})
        elif kind == "content_block_start":
            yield from self._start(int(event["index"]), dict(event.get("content_block") or {}))
        elif kind == "content_block_delta":
            yield from self._delta(int(event["index"]), event.get("delta") or {})
        elif kind == "message_delta":
            delta = event.get("delta") or {}
            self._message.update({k: v for k, v in delta.items() if v is not None})
            # counts are cumulative; one the delta leaves null keeps message_start's
            counts = event.get("usage") or {}
            self._usage.update({k: v for k, v in counts.items() if v is not None})
            finish = _finish(self._message.get("stop_reason"), self._json_answer())
            self.stopped = self.stopped or finish is not None
            yield self._chunk({}, finish=finish, usage=usage(self._usage))
        elif kind == "content_block_stop":
            yield from self._stop(int(event["index"]))
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            error = event.get("error") or {}
            raise StreamError(str(error.get("type", "error")), str(error.get("message", "")))
        # ping and events yet unknown change nothing

    def usage_so_far(self) -> dict[str, Any] | None:
        """The usage as chat usage, as the stream has said it so far (its input from
        ``message_start``); None before it."""
        return usage(self._usage) if self._usage else None

    def _start(self, index: int, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self._blocks[index] = block
        if block.get("type") == "tool_use" and block.get("name") != self._json_tool:
            self._partial[index] = []
            n = self._calls[index] = len(self._calls)
            call = {"index": n, "id": block.get("id"), "type": "function"}
            call["function"] = {"name": block.get("name"), "arguments": ""}
            yield self._chunk({"tool_calls": [call]})
        elif block.get("type") == "tool_use":
            self._partial[index] = []
        elif block.get("type") == "text" and block.get("text"):
            yield self._chunk({"content": block["text"]})

    def _delta(self, index: int, delta: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        block = self._blocks.setdefault(index, {"type": "text", "text": ""})
        if delta.get("type") == "text_delta":
            text = str(delta.get("text", ""))
            self._pieces(index, "text").append(text)
            yield self._chunk({"content": text})
        elif delta.get("type") == "input_json_delta":
            part = str(delta.get("partial_json", ""))
            self._partial.setdefault(index, []).append(part)
            if index in self._calls:
                call = {"index": self._calls[index], "function": {"arguments": part}}
                yield self._chunk({"tool_calls": [call]})
            elif block.get("type") == "tool_use":  # the json_schema answer: its JSON is the text
                yield self._chunk({"content": part})
            # else a server tool's input (server_tool_use: a web search's query) is
            # the provider's own business: kept for the block, never the answer's text
        elif delta.get("type") == "thinking_delta":
            self.thinking = True
            text = str(delta.get("thinking", ""))
            self._pieces(index, "thinking").append(text)
            if text:
                yield self._chunk({"reasoning_content": text})
        elif delta.get("type") == "signature_delta":  # the block's one signature, last
            self.thinking = True
            block["signature"] = str(delta.get("signature", ""))

    def _stop(self, index: int) -> Iterator[dict[str, Any]]:
        """A thinking block, whole, goes out signed as it ends (its text went out as it
        came, as ``reasoning_content``). A tool_use block that sent no input fragment
        has the input its start said: ``{}`` (an empty JSON text is no arguments), for
        the reader as for the answer."""
        if self._blocks.get(index, {}).get("type") in THINKING_BLOCK_TYPES:
            self.thinking = True
            yield self._chunk({"thinking_blocks": [thinking_block(self._whole(index))]})
            return
        partial = self._partial.get(index)
        if partial is None or any(partial) or self._blocks.get(index, {}).get("type") != "tool_use":
            return
        partial.append("{}")
        if index in self._calls:
            yield self._chunk(
                {"tool_calls": [{"index": self._calls[index], "function": {"arguments": "{}"}}]}
            )
        else:
            yield self._chunk({"content": "{}"})

    def _pieces(self, index: int, field: str) -> list[str]:
        """Where block ``index``'s ``field`` (its text, or its thinking) gathers as its
        deltas come, its start's own text first: joined once, at the end (added to as
        they came, 16 MB of text cost 33 s of the I/O loop; found by a hunt)."""
        pieces = self._texts.get(index)
        if pieces is None:
            said = self._blocks[index].get(field)
            pieces = self._texts[index] = [said] if isinstance(said, str) and said else []
        return pieces

    def _whole(self, index: int) -> dict[str, Any]:
        """Block ``index`` as its deltas have made it so far."""
        block = dict(self._blocks[index])
        pieces = self._texts.get(index)
        if pieces is not None:
            field = "thinking" if block.get("type") in THINKING_BLOCK_TYPES else "text"
            block[field] = "".join(pieces)
        return block

    def _json_answer(self) -> bool:
        return self._json_tool is not None and not self._calls

    def _chunk(
        self,
        delta: dict[str, Any],
        *,
        finish: str | None = None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self._message.get("id"),
            "object": "chat.completion.chunk",
            "model": self._message.get("model"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def completion(self) -> dict[str, Any]:
        """The whole answer so far, as ``completion`` gives it."""
        content = []
        for index in sorted(self._blocks):
            block = self._whole(index)
            if index in self._partial:  # the text the chunks carried, as written
                block["input"] = "".join(self._partial[index]) or "{}"
            content.append(block)
        message = {**self._message, "content": content, "usage": self._usage}
        return completion(message, json_tool=self._json_tool)


class StreamError(RuntimeError):
    """The provider sent an ``error`` event mid-stream (``overloaded_error``...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
