"""Azure OpenAI as a dialect of the chat wire, sans-IO: the same bodies and answers as
OpenAI's, at a deployment's URL, with the key in an ``api-key`` header.

A model whose ``api`` is ``azure`` names its resource's endpoint as ``base_url``
(``https://NAME.openai.azure.com``) and its deployment as ``provider_model``;
``chat_url`` builds ``{endpoint}/openai/deployments/{deployment}/chat/completions
?api-version=...`` (an ``api-version`` already in ``base_url``'s query wins, so a
configuration written for the SDK's ``azure_endpoint`` keeps working). The body's
``model`` is the deployment's business, not ours: Azure ignores it, we send it
anyway. Pure: strings in, strings out.
"""

from __future__ import annotations

import urllib.parse

__all__ = ["API_VERSION", "chat_url", "headers"]

API_VERSION = "2024-10-21"
"""The generally available data-plane API version used when ``base_url`` names none."""


def chat_url(base_url: str, deployment: str, api_version: str = API_VERSION) -> str:
    """The chat completions URL of ``deployment`` at the resource ``base_url``."""
    parts = urllib.parse.urlsplit(base_url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.setdefault("api-version", api_version)
    root = parts.path.rstrip("/")
    if root.endswith("/openai"):
        root = root.removesuffix("/openai")
    name = urllib.parse.quote(deployment, safe="")
    path = f"{root}/openai/deployments/{name}/chat/completions"
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, path, urllib.parse.urlencode(query), "")
    )


def headers(api_key: str) -> dict[str, str]:
    """The key goes in ``api-key``, not ``Authorization``."""
    return {"api-key": api_key}
