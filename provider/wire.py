"""OpenAI wire shapes for the simulated provider: request parsing and response bodies.

Pure: bytes and dicts in, dicts out. Invariants: a body that `parse_chat`
accepts has a non-empty ``model`` and at least one message whose content is
countable; `count_prompt_tokens` is the only prompt-size rule, so what the
limits charge and what ``usage`` reports cannot disagree; error bodies never
carry request data (in particular never an API key).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BadRequestError",
    "ChatRequest",
    "completion_body",
    "count_prompt_tokens",
    "error_body",
    "models_body",
    "parse_chat",
]

_FILLER_TEXT = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jam"
_WORDS = tuple(_FILLER_TEXT.split())


class BadRequestError(ValueError):
    """The client sent a chat request we refuse with 400; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the provider needs from a chat request."""

    model: str
    prompt_tokens: int
    max_tokens: int | None


def count_prompt_tokens(messages: Sequence[Mapping[str, object]]) -> int:
    """ceil(len(content) / 4) + 4 per message, + 3 for the reply primer."""
    return sum(-(-_content_chars(m.get("content")) // 4) + 4 for m in messages) + 3


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return sum(
            len(text)
            for part in content
            if isinstance(part, dict) and isinstance(text := part.get("text"), str)
        )
    return 0


def parse_chat(body: bytes) -> ChatRequest:
    """The chat request in ``body``, or `BadRequestError` saying what is wrong with it."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError("We could not parse the JSON body of your request.") from exc
    if not isinstance(data, dict):
        raise BadRequestError("The request body must be a JSON object.")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("you must provide a model parameter", "model")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty array", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise BadRequestError("each message must be an object", "messages")
    return ChatRequest(model, count_prompt_tokens(messages), _max_tokens(data))


def _max_tokens(data: dict[str, object]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequestError(f"'{key}' must be a positive integer", key)
        return value
    return None


def error_body(
    message: str, kind: str, *, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_body(
    *,
    completion_id: str,
    model: str,
    created: int,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: str,
) -> dict[str, object]:
    """A ``chat.completion`` object with deterministic filler content."""
    message = {"role": "assistant", "content": filler(completion_tokens), "refusal": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
        "system_fingerprint": "fp_callboard",
    }


@functools.lru_cache(maxsize=256)
def filler(words: int) -> str:
    """``words`` deterministic filler words."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


def models_body(names: Iterable[str]) -> dict[str, object]:
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "callboard"} for n in names]
    return {"object": "list", "data": data}
