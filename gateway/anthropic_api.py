"""Anthropic's Messages API as the gateway speaks it: request bodies in, answers out.

Theory of operation
-------------------
callboard's request is a Chat Completions body (``callboard.messages``), and the
model actor that serves it speaks its own dialect (``callboard.wire``). So a
``POST /v1/messages`` body is read into the same ``ChatCall`` a chat completions
body gives (``messages_call``), field by field as Anthropic's API reference has
them:

    Messages field                       submit's (Chat Completions) field
    model, max_tokens (both required)    model (a model, route or auto), max_tokens
    system (a string or text blocks)     a first ``system`` message
    messages[].content text block        a ``text`` part
    ... image block (base64 or url)      an ``image_url`` part (a data: URL, or the url)
    ... assistant tool_use blocks        the assistant message's ``tool_calls``
                                         (``input`` dumped as the ``arguments`` text)
    ... user tool_result block           a ``tool`` message (``tool_call_id``), in order
    stop_sequences                       stop
    temperature (0-1), top_p             temperature, top_p
    top_k                                extra_body.top_k (for the provider to judge:
                                         Anthropic's and vLLM's take it)
    tools (custom: name, description,    function tools (``input_schema`` as
      input_schema, strict)              ``parameters``)
    tool_choice auto/any/tool/none,      tool_choice auto/required/{function}/none,
      disable_parallel_tool_use          parallel_tool_calls false
    metadata.user_id                     user
    output_config.format (json_schema)   response_format json_schema
    thinking {"type": "disabled"}        (nothing to do)
    thinking enabled or adaptive         thinking (sent to a model of Anthropic's dialect
                                         only: a fallback of another goes on without it)
    ... assistant thinking and           the assistant message's ``thinking_blocks``,
      redacted_thinking blocks           signed as they came (LiteLLM's field; a block
                                         with no signature, thought by another kind of
                                         model, cannot be replayed: left out)
    stream                               the gateway streams events
    priority (callboard's own)           the request's priority

A field or block that cannot be carried (``cache_control``,
``document`` blocks, a ``tool_result`` marked ``is_error``,
server tools, ``service_tier``, ``container``, ``mcp_servers``...) is an
``InvalidRequestError`` naming it, never dropped in silence; an unknown one too
(Anthropic's API refuses extra inputs). The values themselves are checked where
every request is checked (``Request``), but for those whose range differs from
OpenAI's (``temperature``).

``message_body`` is the answer as a ``message`` (its thinking blocks first, then
text and ``tool_use`` blocks, ``stop_reason``, usage), and ``MessageEvents`` turns
the deltas of a stream into Anthropic's event sequence (``message_start``, then per
block ``content_block_start``, ``content_block_delta`` with ``thinking_delta`` and
then ``signature_delta``, ``text_delta`` or ``input_json_delta``,
``content_block_stop``; ``message_delta`` with the stop
reason and usage, ``message_stop``; an ``error`` event for a stream cut after it
began). ``error_event`` is that event. The stop reason and usage mappings are
``wire.anthropic``'s, read backwards.

What must hold: a tool call's id is the same on both sides (``tool_use.id`` ==
``tool_call_id``), so a conversation round-trips; each stream's events are the
sequence the ``anthropic`` SDK accumulates into the same message ``message_body``
gives for its result. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from callboard.gateway.openai_api import ChatCall
from callboard.messages import (
    THINKING_BLOCK_TYPES,
    Completed,
    InvalidRequestError,
    MalformedOutputError,
    Priority,
    Result,
    StreamDelta,
    ToolCallDelta,
    Usage,
    is_number,
)
from callboard.wire.anthropic import (
    FINISH_REASONS,
    MAX_TEMPERATURE,
    REFUSED,
    message_usage,
    stop_reason_of,
    thinking_block,
)

__all__ = [
    "MessageEvents",
    "error_event",
    "message_body",
    "message_id",
    "messages_call",
    "model_info",
    "models_page",
    "provider_stop",
]

Event = tuple[str, dict[str, Any]]
"""One server-sent event: its ``event:`` name and its ``data`` object."""

_MAPPED: Final = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "output_config",
        "thinking",
        "stream",
        "priority",
    }
)
_UNCARRIED: Final[Mapping[str, str]] = {
    "cache_control": "prompt caching marks cannot be carried through callboard's chat wire",
    "container": "containers belong to Anthropic's own tools, which callboard does not run",
    "context_management": "context editing is Anthropic's own and cannot be carried",
    "mcp_servers": "MCP servers belong to Anthropic's own API and cannot be carried",
    "service_tier": "callboard schedules by priority: send X-Callboard-Priority",
    "inference_geo": "callboard cannot carry where the provider runs the request",
    "speed": "callboard cannot carry a speed to every provider",
    "output_format": "send output_config.format",
}
"""Messages fields the reference lists that callboard cannot carry, and why."""
_BLOCK_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "text": frozenset({"type", "text"}),
    "image": frozenset({"type", "source"}),
    "tool_use": frozenset({"type", "id", "name", "input"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}
_TOOL_KEYS: Final = frozenset({"type", "name", "description", "input_schema", "strict"})
_CHOICES: Final[Mapping[str, str]] = {"auto": "auto", "any": "required", "none": "none"}
_MAX_STOPS: Final = 4
"""The most stop sequences a chat request carries (OpenAI's ``stop``)."""
_JSON_ANSWER: Final = "output"
"""The ``json_schema`` name given to an ``output_config.format`` schema."""


def _refused(field: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {why}")


# -- requests ---------------------------------------------------------------------------------


def messages_call(body: object) -> ChatCall:
    """Read a ``POST /v1/messages`` body (``InvalidRequestError`` naming what is wrong)."""
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the body must be a JSON object")
    for key in body:
        if key in _UNCARRIED:
            raise _refused(key, _UNCARRIED[key])
        if key not in _MAPPED:
            raise _refused(key, "not a Messages API field callboard knows")
    for required in ("model", "max_tokens", "messages"):
        if body.get(required) is None:  # null is none given: Anthropic's API refuses it
            raise _refused(required, "Field required")  # (the OpenAI door reads it so too)
    name = body["model"]
    if not isinstance(name, str) or not name.strip():
        raise _refused("model", "a model or route name (or auto)")
    stream = body.get("stream")
    stream = False if stream is None else stream  # {} or 0: refused, not taken as false
    if not isinstance(stream, bool):
        raise _refused("stream", f"must be true or false, got {stream!r}")
    priority = body.get("priority")
    return ChatCall(
        name=name,
        messages=[*_system(body.get("system")), *_messages(body["messages"])],
        fields=_fields(body),
        stream=stream,
        priority=None if priority is None else Priority.parse(priority),
    )


def _fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``submit``'s keywords for the body's other fields."""
    fields: dict[str, Any] = {"max_tokens": body["max_tokens"], **_sampling(body)}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _refused("stop_sequences", "must be a list of strings")
        if len(stop) > _MAX_STOPS:
            raise _refused(
                "stop_sequences",
                f"callboard carries at most {_MAX_STOPS} (its chat wire's limit), got {len(stop)}",
            )
        if stop:
            fields["stop"] = stop
    if body.get("tools") is not None:
        fields["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        fields.update(_tool_choice(body["tool_choice"]))
    if body.get("metadata") is not None:
        fields.update(_metadata(body["metadata"]))
    if body.get("output_config") is not None:
        fields.update(_output_config(body["output_config"]))
    return fields


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """``submit``'s keywords for how the answer is sampled, and thought."""
    fields: dict[str, Any] = {}
    temperature = body.get("temperature")
    if temperature is not None:
        if not is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
            raise _refused("temperature", f"must be a number from 0 to {MAX_TEMPERATURE}")
        fields["temperature"] = temperature
    if body.get("top_p") is not None:
        fields["top_p"] = body["top_p"]
    if body.get("top_k") is not None:
        fields["extra_body"] = {"top_k": body["top_k"]}
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:  # to a Claude model only: a fallback goes on without it
        fields["thinking"] = thinking
    return fields


def _system(system: object) -> list[dict[str, Any]]:
    """The ``system`` field as a first system message (none when absent or empty)."""
    if system is None or system in ("", []):
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise _refused("system", "must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise _refused(f"system[{i}]", "must be a text block")
        extra = set(block) - _BLOCK_KEYS["text"]
        if extra:
            key = min(extra)
            raise _refused(f"system[{i}].{key}", _UNCARRIED.get(key, "not a field of a text block"))
        parts.append(_text(block, f"system[{i}]"))
    return [{"role": "system", "content": parts}]


def _messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise _refused("messages", "must be a list of messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise _refused(at, "must be an object")
        extra = set(message) - {"role", "content"}
        if extra:
            raise _refused(f"{at}.{min(extra)}", "not a field of a message")
        role, content = message.get("role"), message.get("content")
        if role == "user":
            out.extend(_user(content, f"{at}.content"))
        elif role == "assistant":
            out.append(_assistant(content, f"{at}.content"))
        else:
            raise _refused(f"{at}.role", f"must be user or assistant, got {role!r}")
    return out


def _blocks(content: object, where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """A message's content as ``(where, block)`` pairs, each block of a known type and
    with no key callboard cannot carry."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise _refused(where, "must be a string or a list of content blocks")
    blocks = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if not isinstance(block, Mapping) or not isinstance(kind, str):
            raise _refused(at, "must be a content block (an object with a type)")
        keys = _BLOCK_KEYS.get(kind)
        if keys is None:
            raise _refused(f"{at}.type", f"a {kind!r} block cannot be carried through callboard")
        extra = set(block) - keys
        if extra:
            key = min(extra)
            why = _UNCARRIED.get(key, f"not a field of a {kind} block")
            raise _refused(f"{at}.{key}", why)
        blocks.append((at, block))
    return blocks


def _user(content: object, where: str) -> list[dict[str, Any]]:
    """A user turn as chat messages: its tool results as ``tool`` messages, the blocks
    between them as user messages, in the order given."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for at, block in _blocks(content, where):
        kind = block["type"]
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "image":
            parts.append(_image(block.get("source"), f"{at}.source"))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(block, at))
        else:
            raise _refused(f"{at}.type", f"a {kind} block belongs in an assistant turn")
    if parts or not out:
        only_text = isinstance(content, str)
        out.append({"role": "user", "content": content if only_text else parts})
    return out


def _assistant(content: object, where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[dict[str, Any]] = []
    for at, block in _blocks(content, where):
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, at)["text"])
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif kind in THINKING_BLOCK_TYPES:
            thoughts += _thought(block, at)
        else:
            raise _refused(f"{at}.type", f"a {kind} block belongs in a user turn")
    message: dict[str, Any] = {
        "role": "assistant",
        "content": _content_of(texts) if texts else None,
    }
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["thinking_blocks"] = thoughts
    return message


def _thought(block: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """A thinking block sent back, as the chat turn's ``thinking_blocks`` carry it:
    none for one without a signature (thought by a model that signs nothing, such as
    DeepSeek's through this door: no API takes it back)."""
    if block["type"] == "redacted_thinking":
        data = block.get("data")
        if not isinstance(data, str) or not data:
            raise _refused(f"{where}.data", "must be a non-empty string")
        return [thinking_block(block)]
    thinking, signature = block.get("thinking"), block.get("signature")
    if not isinstance(thinking, str):
        raise _refused(f"{where}.thinking", "must be a string")
    if signature is not None and not isinstance(signature, str):
        raise _refused(f"{where}.signature", "must be a string")
    return [thinking_block(block)] if signature else []


def _content_of(texts: list[str]) -> str | list[dict[str, Any]]:
    """A chat message's content of ``texts``: one text is a string; several stay text
    parts, as they came (glued, two blocks ran together with nothing between)."""
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


def _text(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    text = block.get("text")
    if not isinstance(text, str):
        raise _refused(f"{where}.text", "must be a string")
    return {"type": "text", "text": text}


def _image(source: object, where: str) -> dict[str, Any]:
    kind = source.get("type") if isinstance(source, Mapping) else None
    if isinstance(source, Mapping) and kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise _refused(where, "a base64 source needs media_type and data")
        url = f"data:{media};base64,{data}"
    elif isinstance(source, Mapping) and kind == "url":
        given = source.get("url")
        if not isinstance(given, str):
            raise _refused(f"{where}.url", "must be a string")
        url = given
    else:
        raise _refused(f"{where}.type", "an image source must be base64 or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, Mapping):
        raise _refused(f"{where}.input", "must be an object")
    return {
        "id": _named(block, "id", where),
        "type": "function",
        "function": {"name": _named(block, "name", where), "arguments": json.dumps(arguments)},
    }


def _named(block: Mapping[str, Any], key: str, where: str) -> str:
    """``block[key]``, a non-empty string, checked here so that an error names the
    block's own field (not the chat message's it becomes)."""
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise _refused(f"{where}.{key}", "must be a non-empty string")
    return value


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if block.get("is_error"):
        raise _refused(
            f"{where}.is_error",
            "a chat tool message cannot be marked as an error: say so in its content",
        )
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise _refused(at, "a chat tool message carries text blocks only")
            extra = set(part) - _BLOCK_KEYS["text"]
            if extra:
                raise _refused(f"{at}.{min(extra)}", _UNCARRIED.get(min(extra), "not carried"))
            texts.append(_text(part, at)["text"])
        content = _content_of(texts)
    elif not isinstance(content, str):
        raise _refused(f"{where}.content", "must be a string or a list of text blocks")
    return {"role": "tool", "tool_call_id": _named(block, "tool_use_id", where), "content": content}


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _refused("tools", "must be a list of tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise _refused(at, "must be an object")
        if tool.get("type", "custom") != "custom":
            raise _refused(
                f"{at}.type", f"{tool.get('type')!r} is Anthropic's own tool: callboard runs none"
            )
        extra = set(tool) - _TOOL_KEYS
        if extra:
            key = min(extra)
            raise _refused(f"{at}.{key}", _UNCARRIED.get(key, "not a field of a custom tool"))
        if "input_schema" not in tool:
            raise _refused(f"{at}.input_schema", "Field required")
        if not isinstance(tool["input_schema"], Mapping):
            raise _refused(f"{at}.input_schema", "must be an object (a JSON schema)")
        if tool["input_schema"].get("type") != "object":  # Anthropic's own 400; a model of
            raise _refused(  # another dialect failed it as a provider error (502)
                f"{at}.input_schema.type", "must be 'object' (a tool's input is an object)"
            )
        # checked here, so that an error names the tool's own field, not the function's
        function: dict[str, Any] = {
            "name": _named(tool, "name", at),
            "parameters": tool["input_schema"],
        }
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise _refused(f"{at}.description", "must be a string")
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            if not isinstance(tool["strict"], bool):
                raise _refused(f"{at}.strict", "must be true or false")
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if not isinstance(choice, Mapping) or kind not in (*_CHOICES, "tool"):
        raise _refused("tool_choice", "must be an object whose type is auto, any, tool or none")
    extra = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if extra:
        raise _refused(f"tool_choice.{min(extra)}", "not a field of a tool choice")
    fields: dict[str, Any] = {}
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _refused("tool_choice.name", "a tool choice of type tool names its tool")
        fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        fields["tool_choice"] = _CHOICES[kind]
    if choice.get("disable_parallel_tool_use") and kind != "none":
        fields["parallel_tool_calls"] = False
    return fields


def _metadata(metadata: object) -> dict[str, Any]:
    if not isinstance(metadata, Mapping):
        raise _refused("metadata", "must be an object")
    extra = set(metadata) - {"user_id"}
    if extra:
        raise _refused(f"metadata.{min(extra)}", "not a field of metadata")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise _refused("metadata.user_id", "must be a string")
    return {} if user is None else {"user": user}


def _output_config(config: object) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise _refused("output_config", "must be an object")
    extra = set(config) - {"format"}
    if extra:
        raise _refused(f"output_config.{min(extra)}", "callboard carries only format")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        raise _refused("output_config.format.type", "must be json_schema")
    if not isinstance(fmt.get("schema"), Mapping):
        raise _refused("output_config.format.schema", "must be a JSON schema object")
    schema = {"name": _JSON_ANSWER, "schema": fmt["schema"], "strict": True}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


_THINKING_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "disabled": frozenset({"type"}),
    "enabled": frozenset({"type", "budget_tokens", "display"}),
    "adaptive": frozenset({"type", "display"}),
    "between_tools": frozenset({"type"}),
}
"""``thinking``'s forms in the API reference (anthropic 2.17's ``ThinkingConfigParam``),
and their fields."""


def _thinking(thinking: object) -> dict[str, Any] | None:
    """``thinking`` as the provider gets it (None: nothing to send; ``disabled`` is the
    default). Its values are the provider's to judge (``budget_tokens`` below
    ``max_tokens``...); its shape is checked here."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    keys = _THINKING_KEYS.get(kind) if isinstance(kind, str) else None
    if not isinstance(thinking, Mapping) or keys is None:
        raise _refused("thinking.type", f"must be one of {sorted(_THINKING_KEYS)}")
    extra = set(thinking) - keys
    if extra:
        raise _refused(f"thinking.{min(extra)}", f"not a field of {kind} thinking")
    if kind == "disabled":
        return None
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (type(budget) is not int or budget < 1):
        raise _refused("thinking.budget_tokens", "a whole number of tokens is required")
    return dict(thinking)


# -- answers ----------------------------------------------------------------------------------


UNKNOWN_RELEASE: Final = "1970-01-01T00:00:00Z"
"""A model's ``created_at`` (its release date, which callboard does not know: Anthropic's
docs allow the epoch then)."""
MOST_PER_PAGE: Final = 1000


def model_info(name: str) -> dict[str, Any]:
    """``ModelInfo``, as ``GET /v1/models/{model_id}`` answers it."""
    return {"type": "model", "id": name, "display_name": name, "created_at": UNKNOWN_RELEASE}


def models_page(names: list[str], query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /v1/models`` in Anthropic's shape: a page of ``limit`` (1..1000, 20 unless
    said) after ``after_id`` or before ``before_id``, with ``has_more``, ``first_id``
    and ``last_id`` (the anthropic SDK pages on with ``after_id``). An id the list does
    not hold, or a limit that is no whole number in range, is an
    ``InvalidRequestError`` naming the parameter."""
    text = query.get("limit", "20")
    whole = text.isascii() and text.isdigit() and len(text) <= 4  # int() refuses "²", and
    if not whole or not 1 <= int(text) <= MOST_PER_PAGE:  # 4,300 digits: a 500 (a hunt)
        raise InvalidRequestError(f"limit: a whole number from 1 to {MOST_PER_PAGE}")
    limit = int(text)
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise InvalidRequestError("after_id, before_id: give one of them, not both")
    for cursor, given in (("after_id", after), ("before_id", before)):
        if given is not None and given not in names:
            raise InvalidRequestError(f"{cursor}: no model {given[:100]!r} in this list")
    if before is not None:
        end = names.index(before)
        page = names[max(0, end - limit) : end]
        more = end - limit > 0
    else:
        start = 0 if after is None else names.index(after) + 1
        page = names[start : start + limit]
        more = start + limit < len(names)
    return {
        "data": [model_info(n) for n in page],
        "has_more": more,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }


def message_id(task_id: int) -> str:
    """The ``id`` of the message answering task ``task_id``."""
    return f"msg_callboard_{task_id}"


def message_body(result: Completed, *, model: str) -> dict[str, Any]:
    """The ``message`` answering ``result`` (``MalformedOutputError`` naming the tool
    call whose arguments are not a JSON object: a ``tool_use`` block's ``input`` is
    one; but an answer cut at ``max_tokens`` is no error: a call it cut short has the
    input ``{}``, as its stream gives it, and the stop reason says ``max_tokens``)."""
    content: list[dict[str, Any]] = _thinking_of(result)
    refusal = None if result.refusal == REFUSED else result.refusal  # the model's words only
    text = result.content or refusal or ""  # (callboard's note of an Anthropic refusal was
    # sent as the model's text; found by a hunt)
    if text:
        content.append({"type": "text", "text": text})
    cut = result.finish_reason == "length"
    for call in result.tool_calls:
        try:
            arguments = call.parsed_arguments()
        except MalformedOutputError:
            if not cut:
                raise
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise MalformedOutputError(
                f"the arguments of tool call {call.id!r} to {call.name!r} are not a JSON object"
            )
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
    return {
        "id": message_id(result.task_id),
        "type": "message",
        "role": "assistant",
        "model": result.model or model,
        "content": content,
        **_stop(result.finish_reason, provider_stop(result)),
        "usage": _usage(result.usage),
    }


def _thinking_of(result: Completed) -> list[dict[str, Any]]:
    """The answer's thinking blocks, first in its message: a Claude model's, signed, as
    they came; a model's reasoning without them (DeepSeek's) as one thinking block with
    no signature."""
    if result.thinking_blocks:
        return [dict(b) for b in result.thinking_blocks if b.get("type") in THINKING_BLOCK_TYPES]
    if result.reasoning:
        return [{"type": "thinking", "thinking": result.reasoning, "signature": ""}]
    return []


ProviderStop = tuple[str | None, str | None]
"""An Anthropic provider's own ``stop_reason`` and ``stop_sequence`` (None: not said)."""


def provider_stop(result: Result) -> ProviderStop:
    """How ``result``'s answer ended as its provider said it, when the provider speaks
    Anthropic's dialect (OpenAI's ``finish_reason`` says less: ``stop`` for a stop
    sequence, ``length`` for a full context window): read from its body, as received
    (a ``message``) or as callboard assembled a stream (a ``chat.completion`` whose
    choice keeps them)."""
    raw = getattr(result, "raw", None)  # a Completed's
    if not isinstance(raw, Mapping):
        return None, None
    said: Any = raw
    if raw.get("type") != "message":
        choices = raw.get("choices")
        said = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(said, Mapping):
        return None, None
    reason, sequence = said.get("stop_reason"), said.get("stop_sequence")
    return (
        reason if isinstance(reason, str) else None,
        sequence if isinstance(sequence, str) else None,
    )


def _stop(finish_reason: str | None, said: ProviderStop) -> dict[str, Any]:
    """The message's ``stop_reason`` and ``stop_sequence``: the provider's own where it
    agrees with ``finish_reason`` (a stream reported ``max_tokens`` for a context
    window's end, found by a hunt), else the finish reason's."""
    reason, sequence = said  # a sequence is said only with its reason, stop_sequence
    if reason is not None and FINISH_REASONS.get(reason) == (finish_reason or "stop"):
        return {
            "stop_reason": reason,
            "stop_sequence": sequence if reason == "stop_sequence" else None,
        }
    return {"stop_reason": stop_reason_of(finish_reason), "stop_sequence": None}


def _usage(usage: Usage) -> dict[str, Any]:
    return message_usage(
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        usage.cache_write_tokens,
        usage.cache_write_1h_tokens,
    )


class MessageEvents:
    """One stream's events, from its deltas: ``delta`` for each as it arrives, ``end``
    once the result is known (or ``error_event`` if the stream was cut). The message
    starts with the first event written, whatever it is.

    Anthropic's blocks come one after another, each whole before the next begins;
    OpenAI's tool calls may interleave (fragments of call 1 between those of call 0,
    told apart by ``index``), and a call's fragments carry no end. So the text streams
    in a block of its own until the first tool call; that call streams in its block;
    every later call, and text after a call, is held and written whole, in order,
    when the message ends (when no more fragment can come)."""

    def __init__(self, *, message_id: str, model: str, input_tokens: int = 0) -> None:
        self._id = message_id
        self._model = model
        self._input_tokens = input_tokens
        """The prompt's size as known at the start (callboard's estimate): what
        ``message_start`` says, as Anthropic's does; ``message_delta`` has the count."""
        self._started = False
        self._index = -1
        self._open: tuple[str, int] | None = None
        """The open block: ``("text", 0)``, or ``("tool", the call's index)``."""
        self._live_call: int | None = None
        """The index of the call streaming in its block (the first call)."""
        self._held: list[dict[str, Any]] = []
        """What comes after the first call, written at the end in the order it began: a
        later call (``index``, id, name, argument fragments) or a run of text."""
        self._held_calls: dict[int, dict[str, Any]] = {}
        """The held calls by their index (their fragments may interleave)."""
        self._finish: str | None = None
        self._thoughts = 0
        """Thinking blocks ended (the key of the next one)."""

    def delta(self, delta: StreamDelta) -> list[Event]:
        events = self._start()
        if delta.reasoning or delta.thinking_blocks:  # a Claude model's interleaved
            if self._live_call is None:  # thinking comes between its text and its calls:
                events += self._thinking(delta)  # in its place, as the answer has it
            else:  # (written only before the first call, what came after a call was
                self._hold_thinking(delta)  # lost from the stream; found by a hunt)
        text = delta.text or delta.refusal
        if text and self._live_call is None:
            events += self._block(("text", 0), {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        elif text:
            last = self._held[-1] if self._held else None
            if last is None or "text" not in last:
                last = {"text": []}
                self._held.append(last)
            last["text"].append(text)
        events += self._calls(delta.tool_calls)
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
        return events

    def _calls(self, calls: tuple[ToolCallDelta, ...]) -> list[Event]:
        """The first call streams in its block; every later one is held, whole."""
        events: list[Event] = []
        for call in calls:
            if self._live_call is None:
                self._live_call = call.index
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": {},
                }
                events += self._block(("tool", call.index), block)
            if call.index == self._live_call:
                if call.arguments:
                    partial = {"type": "input_json_delta", "partial_json": call.arguments}
                    events.append(self._delta(partial))
                continue
            held = self._held_calls.get(call.index)
            if held is None:
                held = {"index": call.index, "id": None, "name": None, "arguments": []}
                self._held_calls[call.index] = held
                self._held.append(held)
            held["id"] = held["id"] or call.id
            held["name"] = held["name"] or call.name
            if call.arguments:
                held["arguments"].append(call.arguments)
        return events

    def _thinking(self, delta: StreamDelta) -> list[Event]:
        """A thinking block's text as it comes; its signature, or a redacted block
        whole, as it ends (``thinking_blocks``)."""
        events: list[Event] = []
        if delta.reasoning:
            events += self._block(("thinking", self._thoughts), dict(_OPEN_THOUGHT))
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        for block in delta.thinking_blocks:
            if block.get("type") == "redacted_thinking":
                redacted = _redacted(block.get("data", ""))
                events += self._block(("redacted", self._thoughts), redacted)
            else:
                events += self._block(("thinking", self._thoughts), dict(_OPEN_THOUGHT))
                signature = {"type": "signature_delta", "signature": block.get("signature", "")}
                events.append(self._delta(signature))
            events += self._close()
            self._thoughts += 1
        return events

    def _hold_thinking(self, delta: StreamDelta) -> None:
        """Thinking after the first call, held as text and calls are: its text joins
        the thinking held last if that has not ended; each block ends one."""
        if delta.reasoning:
            self._held_thought()["thinking"].append(delta.reasoning)
        for block in delta.thinking_blocks:
            if block.get("type") == "redacted_thinking":
                self._held.append({"redacted": block.get("data", "")})
            else:
                self._held_thought()["signature"] = block.get("signature", "")

    def _held_thought(self) -> dict[str, Any]:
        """The thinking held last, if it has not ended (no signature yet), else a new one."""
        last = self._held[-1] if self._held else None
        if last is None or "thinking" not in last or "signature" in last:
            last = {"thinking": []}
            self._held.append(last)
        return last

    def _held_blocks(self) -> list[Event]:
        """What was held, each a whole block, in the order it began."""
        events: list[Event] = []
        for n, held in enumerate(self._held, 1):
            if "redacted" in held:
                events += self._block(("redacted", -n), _redacted(held["redacted"]))
                continue
            if "thinking" in held:
                events += self._block(("thinking", -n), dict(_OPEN_THOUGHT))
                if held["thinking"]:
                    thought = "".join(held["thinking"])
                    events.append(self._delta({"type": "thinking_delta", "thinking": thought}))
                if held.get("signature"):
                    signed = {"type": "signature_delta", "signature": held["signature"]}
                    events.append(self._delta(signed))
                continue
            if "text" in held:
                events += self._block(("text", n), {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": "".join(held["text"])}))
                continue
            block = {"type": "tool_use", "id": held["id"], "name": held["name"], "input": {}}
            events += self._block(("tool", held["index"]), block)
            if held["arguments"]:
                whole = "".join(held["arguments"])
                events.append(self._delta({"type": "input_json_delta", "partial_json": whole}))
        self._held.clear()
        self._held_calls.clear()
        return events

    def end(
        self, usage: Usage, finish_reason: str | None, said: ProviderStop = (None, None)
    ) -> list[Event]:
        """The message's last events: its open block closed, the stop reason (the last
        delta's finish, else ``finish_reason``; the provider's own stop reason and
        sequence where it ``said`` them) and usage, ``message_stop``."""
        events = self._start()
        events += self._held_blocks()
        events += self._close()
        stop = _stop(self._finish or finish_reason, said)
        events.append(
            ("message_delta", {"type": "message_delta", "delta": stop, "usage": _usage(usage)})
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # the prompt's size as known now (0 said a client reading it here had none;
            # a hunt); the totals come in message_delta, as Anthropic's streams do
            "usage": {"input_tokens": self._input_tokens, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _block(self, key: tuple[str, int], block: dict[str, Any]) -> list[Event]:
        if self._open == key:
            return []
        events = self._close()
        self._index += 1
        self._open = key
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        events.append(("content_block_start", start))
        return events

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )


_OPEN_THOUGHT: Final = {"type": "thinking", "thinking": "", "signature": ""}
"""A thinking block as its stream opens it: text and signature follow in deltas."""


def _redacted(data: object) -> dict[str, Any]:
    """A redacted thinking block, whole in its start, as Anthropic's streams send one."""
    return {"type": "redacted_thinking", "data": data}


def error_event(body: Mapping[str, Any]) -> Event:
    """The ``error`` event ending a stream cut after it began (``body``: the error's
    Anthropic body)."""
    return ("error", dict(body))
