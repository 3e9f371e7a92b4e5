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

__all__ = [
    "API_VERSION",
    "STREAM_USAGE_SINCE",
    "chat_url",
    "headers",
    "streams_usage",
    "version_of",
]

API_VERSION = "2024-10-21"
"""The generally available data-plane API version used when ``base_url`` names none."""
STREAM_USAGE_SINCE = "2024-09-01"
"""The first API version that takes ``stream_options``: the versions before it (the GA
``2024-06-01`` and ``2024-02-01`` among them) refuse a body carrying it with a 400,
"Unrecognized request argument supplied: stream_options"."""


def version_of(base_url: str, api_version: str | None) -> str:
    """The API version a model's calls ask for: ``base_url``'s ``api-version``, else
    ``api_version``, else ``API_VERSION``."""
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(base_url).query))
    return query.get("api-version") or api_version or API_VERSION


def streams_usage(version: str) -> bool:
    """Whether API ``version`` takes ``stream_options`` (a stream's usage, asked for).
    A version that is not a date (a newer naming) is taken to."""
    day = version[:10]
    dated = len(day) == 10 and day[4] == day[7] == "-" and day.replace("-", "").isdigit()
    return not dated or day >= STREAM_USAGE_SINCE


def chat_url(base_url: str, deployment: str, api_version: str = API_VERSION) -> str:
    """The chat completions URL of ``deployment`` at the resource ``base_url``."""
    parts = urllib.parse.urlsplit(base_url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query["api-version"] = version_of(base_url, api_version)
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
