"""Secrets as values: what prints masked, and what in a URL is a secret.

``Secret`` holds a value that only ``reveal()`` gives; its repr and str show a
mask: ``Secret('***')``, or for a URL the URL with its secret parts masked
(``Secret('https://***@api.example/v1?key=***')``), so an error can still say
which host it was about.

A URL carries secrets in two places:

- its userinfo (``user:password@``): the password, and ``user:password``
  whole (what a Basic ``Authorization`` header encodes); the user name alone
  when there is no password (some services take the key as the user name);
- the values of query parameters named as credentials (``_key_like``); others (Azure's
  ``api-version=``) are not secret.

A value that is not known to be secret may still be one, typed in the wrong
field (a key pasted as a header's name or a model's name): ``quoted`` is how an
error quotes such a value, whole only when short.

A URL marked secret as a whole (``Secret``, or read from the environment) may
hold its secret elsewhere, in its path: ``unmarked_secrets`` lists what of it a
server may echo.

``url_secrets`` lists them, as written and as decoded; ``masked_url`` shows
the URL with each as ``***``; ``guarded_url`` wraps a URL that has some in a
``Secret`` showing it masked; ``url_credentials`` gives the userinfo decoded
(the HTTP layer sends it as a Basic ``Authorization`` header).

What must hold: no function here returns a secret part in its text, or raises
with one, except ``Secret.reveal``, ``url_secrets``, ``unmarked_secrets`` and
``url_credentials``; a
URL whose authority cannot be read is masked whole. Pure: no I/O, no logging.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Final

from callboard.messages import credential_like

MASK: Final = "***"


class Secret:
    """A value that prints masked: ``***``, or ``shown`` (a URL with its secret parts
    masked)."""

    __slots__ = ("_shown", "_value")

    def __init__(self, value: str, *, shown: str = MASK) -> None:
        self._value = value
        self._shown = shown

    @classmethod
    def of_url(cls, url: str) -> Secret:
        """``url`` as a secret that shows it with its secret parts masked; one with no
        part known to be secret (a token in its path?) is shown as ``***`` whole."""
        return cls(url, shown=masked_url(url) if url_secrets(url) else MASK)

    def reveal(self) -> str:
        return self._value

    @property
    def shown(self) -> str:
        """What may be shown of it: ``***``, or the masked URL."""
        return self._shown

    def __repr__(self) -> str:
        return f"Secret({self._shown!r})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def reveal(value: str | Secret) -> str:
    """The text of a value that may be a ``Secret`` (for the HTTP layer only)."""
    return value.reveal() if isinstance(value, Secret) else value


def shown(value: str | Secret) -> str:
    """What may be shown of a value that may be a ``Secret``."""
    return value.shown if isinstance(value, Secret) else value


QUOTED_AT_MOST: Final = 24
"""The longest value an error quotes whole (an API key is longer)."""


def quoted(value: object) -> str:
    """``value`` as an error may quote it: its repr, or for a text longer than
    ``QUOTED_AT_MOST`` characters its first six and its length (a key pasted into
    the wrong field reached the error, and every log that printed it)."""
    if isinstance(value, str) and len(value) > QUOTED_AT_MOST:
        return f"{value[:6]!r}... ({len(value)} characters)"
    return repr(value)


def guarded_url(url: str) -> str | Secret:
    """``url`` itself when nothing in it is secret, else a ``Secret`` showing it masked."""
    return Secret.of_url(url) if url_secrets(url) else url


def url_secrets(url: str) -> tuple[str, ...]:
    """The secret parts of ``url``, each as written and as decoded (see the module)."""
    parts: list[str] = []
    authority = _authority(url)
    if authority is None:
        return (url,)  # unreadable: the whole of it is the secret
    userinfo, at, _ = authority.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if colon and password:
            parts += [password, userinfo]
        elif user:
            parts += [user, f"{user}:"]
    for name, eq, value in _split_query(url.partition("?")[2].partition("#")[0]):
        if eq and value and _key_like(name):
            parts.append(value)
    decoded = [urllib.parse.unquote(p) for p in parts]
    return tuple(dict.fromkeys(parts + decoded))


TOKEN_CHARS: Final = 16
"""The shortest run of letters and digits, both, that makes a part of a secret URL a
token (``tok7HUNTpath0123``): shorter runs, or runs of letters or digits alone, are
names (``openai``, ``v1beta``, ``deployments``, ``gpt-4o-mini-2024-07-18``), which
hidden in every log and answer garbled them (the path ``/openai/v1`` taken whole hid
``https://api.groq.com/openai/v1`` in a model's answer; a review)."""
_RUN = re.compile(r"[A-Za-z0-9]+")
_UUID = re.compile(r"[0-9A-Fa-f]{8}-(?:[0-9A-Fa-f]{4}-){3}[0-9A-Fa-f]{12}")


def _token_like(part: str) -> bool:
    """Whether ``part`` (a host label, a path segment, a query value) holds a token: a
    UUID, or a run of ``TOKEN_CHARS`` letters and digits mixed."""
    if _UUID.search(part):
        return True
    return any(
        len(run) >= TOKEN_CHARS and not run.isalpha() and not run.isdigit()
        for run in _RUN.findall(part)
    )


def unmarked_secrets(url: str) -> tuple[str, ...]:
    """The parts of ``url``, a URL its owner marked secret whose secret parts are not
    known (``url_secrets`` finds none: a token in its path?), that a server may echo
    alone (a 404 says ``Cannot POST /<token>/v1/chat/completions``): each host label,
    path segment and query value that holds a token (``_token_like``); as written and
    as decoded (with ``url`` itself first)."""
    authority = _authority(url)
    if authority is None:
        return (url,)
    tail = url.partition("://")[2][len(authority) :]
    path, _, query = tail.partition("#")[0].partition("?")
    host = authority.rpartition("@")[2]
    pieces = [*host.split("."), *path.split("/"), *(v for _, _, v in _split_query(query))]
    parts = [p for p in pieces if _token_like(urllib.parse.unquote(p))]
    decoded = [urllib.parse.unquote(p) for p in parts]
    return tuple(dict.fromkeys([url, *parts, *decoded]))


def url_credentials(url: str) -> tuple[str, str] | None:
    """The URL's userinfo as (user, password), decoded; None when it has none."""
    authority = _authority(url)
    if authority is None or "@" not in authority:
        return None
    user, _, password = authority.rpartition("@")[0].partition(":")
    return urllib.parse.unquote(user), urllib.parse.unquote(password)


def masked_url(url: str) -> str:
    """``url`` with its userinfo's secret parts and key-like query values as ``***``."""
    authority = _authority(url)
    if authority is None:
        return MASK
    scheme, _, rest = url.partition("://")
    userinfo, at, hostport = authority.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        hostport = f"{user}:{MASK}@{hostport}" if colon and password else f"{MASK}@{hostport}"
    tail = rest[len(authority) :]
    path, q, query = tail.partition("?")
    query, hash_, fragment = query.partition("#")
    if q:
        pairs = (
            f"{name}={MASK}" if eq and value and _key_like(name) else f"{name}{eq}{value}"
            for name, eq, value in _split_query(query)
        )
        path = f"{path}?{'&'.join(pairs)}"
    return f"{scheme}://{hostport}{path}{hash_}{fragment}"


def _authority(url: str) -> str | None:
    """The ``[userinfo@]host[:port]`` of a ``scheme://`` URL; None if it has none, or
    if an ``@`` follows it while it has none (a password holding an unencoded ``/``,
    ``?`` or ``#`` ends the authority early: its remains must not pass for a path)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        return None
    end = len(rest)
    for stop in "/?#":
        at = rest.find(stop)
        if at != -1:
            end = min(end, at)
    authority = rest[:end]
    if "@" in rest[end:] and "@" not in authority:
        return None
    return authority


def _key_like(name: str) -> bool:
    """A query parameter named as a credential holds a secret (``key``, ``api_key``,
    ``access_token``, ``sig``, ``X-Amz-Security-Token``, ``client_secret``, Azure
    Functions' ``code``...): the rule headers follow (``messages.credential_like``)."""
    return credential_like(urllib.parse.unquote_plus(name))


def _split_query(query: str) -> list[tuple[str, str, str]]:
    """A query as (name, ``=`` or empty, value) triples, as written."""
    return [piece.partition("=") for piece in query.split("&")] if query else []
