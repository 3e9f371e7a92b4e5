"""Azure OpenAI's URL and key header (wire/azure.py, sans-IO), as Azure's REST reference
shows them."""

from __future__ import annotations

import pytest
from callboard.wire.azure import API_VERSION, chat_url, headers, streams_usage, version_of


@pytest.mark.parametrize(
    "base_url",
    [
        "https://my-res.openai.azure.com",
        "https://my-res.openai.azure.com/",
        "https://my-res.openai.azure.com/openai",
    ],
)
def test_the_deployment_url_carries_the_api_version(base_url: str) -> None:
    assert chat_url(base_url, "gpt-4o-prod") == (
        "https://my-res.openai.azure.com/openai/deployments/gpt-4o-prod/chat/completions"
        f"?api-version={API_VERSION}"
    )


def test_an_api_version_in_the_base_url_wins_and_names_are_quoted() -> None:
    url = chat_url("https://r.openai.azure.com?api-version=2025-01-01-preview", "a b/c")
    assert url == (
        "https://r.openai.azure.com/openai/deployments/a%20b%2Fc/chat/completions"
        "?api-version=2025-01-01-preview"
    )


def test_the_key_goes_in_api_key() -> None:
    assert headers("k") == {"api-key": "k"}


def test_the_version_asked_for_is_the_base_urls_else_the_settings_else_ours() -> None:
    assert version_of("https://r.openai.azure.com?api-version=2024-06-01", "2025-01-01") == (
        "2024-06-01"
    )
    assert version_of("https://r.openai.azure.com", "2025-01-01") == "2025-01-01"
    assert version_of("https://r.openai.azure.com", None) == API_VERSION


@pytest.mark.parametrize(
    ("version", "takes"),
    [
        ("2024-02-01", False),
        ("2024-06-01", False),
        ("2024-08-01-preview", False),
        ("2024-09-01-preview", True),
        ("2024-10-21", True),
        (API_VERSION, True),
        ("preview", True),
        ("latest", True),
    ],
)
def test_stream_options_are_taken_from_2024_09_01(version: str, takes: bool) -> None:
    """The versions before it answer a body with ``stream_options`` 400, "Unrecognized
    request argument supplied"."""
    assert streams_usage(version) is takes
