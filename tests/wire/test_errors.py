"""A provider's error body read once for everyone (wire/errors.py, sans-IO): OpenAI's
and Anthropic's shapes as their API references show them, and what is not one."""

from __future__ import annotations

import json

import pytest
from callboard.wire.errors import error_body


def test_openais_and_anthropics_bodies_give_their_error_objects() -> None:
    openai = {"error": {"message": "m", "type": "invalid_request_error", "param": "x", "code": "c"}}
    anthropic = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    for body in (openai, anthropic):
        read = error_body(json.dumps(body, indent=4))
        assert read is not None
        assert read == (body, body["error"])


@pytest.mark.parametrize(
    "text", ["", "<html>502</html>", '{"error": "a string"}', '["error"]', '{"erro', "null"]
)
def test_what_holds_no_error_object_is_none(text: str) -> None:
    assert error_body(text) is None
