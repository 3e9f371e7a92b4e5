"""The simulated provider's one prompt-size rule, for every wire: callboard's own.

Pure: JSON (already parsed) in, a token count out. What the limits charge and
what ``usage`` reports both come from here, so they cannot disagree; and the
rule is ``callboard.core.tokens.count_chat_tokens``, the estimate callboard
reserves with, so on the simulator an estimate and the reported
``prompt_tokens`` agree exactly (text by ``core.tokens.text_tokens`` plus each dialect's framing;
images by OpenAI's tiles or Anthropic's area; audio, files, tools and schemas
by the rules that function cites).

The Anthropic wire's body is counted as the Chat Completions request it
stands for (`chat_of`: ``system`` a system message, text blocks text parts,
an image block an ``image_url`` part, ``tool_use`` blocks an assistant's
``tool_calls``, ``tool_result`` blocks tool messages, tools function tools),
by Anthropic's rules. Where ``callboard.wire.anthropic`` merged two turns of
one role into one, the count is a few framing tokens lower than callboard's
estimate of the original request, never higher.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from callboard.core.tokens import count_chat_tokens
from callboard.provider.sse import compact

__all__ = ["chat_of", "count_anthropic_tokens", "count_prompt_tokens"]


def count_prompt_tokens(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: Mapping[str, Any] | None = None,
) -> int:
    """Chat Completions messages (and tools, and a response format) as prompt tokens."""
    return count_chat_tokens(messages, tools=tools, response_format=response_format)


def count_anthropic_tokens(body: Mapping[str, Any]) -> int:
    """A Messages request body (``system``, ``messages``, ``tools``) as input tokens."""
    messages, tools = chat_of(body)
    return count_chat_tokens(messages, tools=tools, dialect="anthropic")


def chat_of(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Chat Completions messages and tools a Messages body stands for."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of(system)})
    for turn in body.get("messages") or ():
        if isinstance(turn, Mapping):
            messages.extend(_turn(turn))
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("input_schema"),
            },
        }
        for t in body.get("tools") or ()
        if isinstance(t, Mapping)
    ]
    return messages, tools


def _turn(turn: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results become tool messages."""
    role, content = turn.get("role"), turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in content if isinstance(content, list) else ():
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _url(block.get("source"))}})
        elif kind == "document":
            source = block.get("source")
            data = source.get("data") if isinstance(source, Mapping) else None
            parts.append({"type": "file", "file": {"file_data": data} if data else {}})
        elif kind == "tool_use":
            arguments = compact(block.get("input", {}))
            fn = {"name": block.get("name"), "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
        elif kind == "tool_result":
            text = _text_of(block.get("content") or "")
            results.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}
            )
    out: list[dict[str, Any]] = []
    if parts or calls:
        message: dict[str, Any] = {"role": role, "content": parts or None}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return [*results, *out]


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(b.get("text", "")) for b in content if isinstance(b, Mapping) and "text" in b
        )
    return ""


def _url(source: object) -> str:
    if not isinstance(source, Mapping):
        return ""
    if source.get("type") == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data', '')}"
    return str(source.get("url", ""))
