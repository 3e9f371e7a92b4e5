"""Azure OpenAI's URL and key header (wire/azure.py, sans-IO), as Azure's REST reference
shows them."""

from __future__ import annotations

import pytest
from callboard.wire.azure import API_VERSION, chat_url, headers


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
