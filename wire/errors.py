"""A provider's error body, sans-IO: OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` and Anthropic's ``{"type": "error", "error": {"type", "message"}}``, as
their API references show them. One reading for whoever needs its fields: the HTTP
client writing a call's detail, the core judging what a 400 says, the gateway passing
it on to an SDK. Pure: strings in, mappings out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["error_body"]


def error_body(text: str) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """``text`` read as an error body: the body and its ``error`` object, or None if it
    is not a JSON object holding an ``error`` object. What the error holds is the
    caller's to check (each field may be anything a server sent)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # nested past the parser's depth: no error body
        return None
    error = data.get("error") if isinstance(data, dict) else None
    return None if not isinstance(error, dict) else (data, error)
