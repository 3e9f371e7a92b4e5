"""HTTP's gzip and deflate content codings, decoded incrementally in bounded pieces.

A compressed body inflates to up to about a thousand times its size. Decoded a
read at a time (as httpx's decoders do), 300 KB of gzip became 300 MB of blank
lines in 16 MB parts on the I/O loop: 35 s in which no other call, on any model,
moved (found by a hunt); and 2 MB of gzip in a request body took the gateway's
loop for seconds. An ``Inflater`` hands a body back in pieces of at most
``PIECE`` bytes, however its input came, so that whoever reads it stops at its
own bound and lets other work run between pieces.

What must hold: the pieces joined are the body decoded; gzip may come in up to
``MOST_MEMBERS`` members (each costs a fresh decoder); deflate with its zlib
header or without it, as some servers and clients send it; bytes that are not
what the coding says raise ``InflateError``, as does a body that ends inside its
compressed data (``end``); bytes after the body's end that begin no gzip member
are ignored, as gzip(1) and httpx ignore them; an empty body is empty; zlib is
fed at most ``PIECE`` bytes at a time (its unconsumed tail, copied for each
piece, made a 16 MB gzip body quadratic).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Final

__all__ = [
    "CODINGS",
    "MOST_CODINGS",
    "MOST_MEMBERS",
    "PIECE",
    "Decoder",
    "InflateError",
    "Inflater",
    "coding_of",
    "decodes",
]

CODINGS: Final[dict[str, int]] = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}
"""The codings decoded here, and the window bits that read each."""

_GZIP_MAGIC: Final = b"\x1f\x8b"
PIECE: Final = 64 * 1024
"""The most bytes one piece holds."""

MOST_MEMBERS: Final = 16
"""The gzip members a body may have (a writer makes one; a body of 200,000 empty members
took minutes to read)."""


MOST_CODINGS: Final = 3
"""The codings a body may come in, one applied after another (``gzip, gzip``): each
layer is decoded a piece at a time, so a body of several is bounded as one of one is
(it went whole through httpx's decoders, a read inflated at once: 3 KB of gzip of gzip
took 1.6 GB before the reader's bound saw any of it; found by a hunt)."""


class InflateError(ValueError):
    """A body is not what its ``Content-Encoding`` says, or ended before its end."""


def coding_of(header: str) -> str | None:
    """The one coding a ``Content-Encoding`` value names (lower case; ``identity``
    dropped): None for none, the whole value for several (``"gzip, br"``: none of
    which this module decodes in one go)."""
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return None
    return codings[0] if len(codings) == 1 else ", ".join(codings)


def decodes(coding: str) -> bool:
    """Whether a body in ``coding`` (``coding_of``'s: one, or several in the order they
    were applied) is decoded here."""
    names = coding.split(", ")
    return len(names) <= MOST_CODINGS and all(name in CODINGS for name in names)


class Decoder:
    """One body's decoder for ``coding`` (``decodes`` says it can): the last coding
    applied is undone first, each layer fed the pieces of the one before, so no layer
    ever holds more than ``PIECE`` bytes of output."""

    __slots__ = ("_layers",)

    def __init__(self, coding: str) -> None:
        if not decodes(coding):
            raise ValueError(f"{coding!r} is not a coding this decodes: {sorted(CODINGS)}")
        self._layers = [Inflater(name) for name in reversed(coding.split(", "))]

    def feed(self, data: bytes) -> Iterator[bytes]:
        """As ``Inflater.feed``, through every layer."""
        return _through(self._layers, data)

    def end(self) -> None:
        for layer in self._layers:
            layer.end()


def _through(layers: list[Inflater], data: bytes) -> Iterator[bytes]:
    first, *rest = layers
    if not rest:
        yield from first.feed(data)
        return
    for piece in first.feed(data):
        yield from _through(rest, piece)


class Inflater:
    """One body's decoder: ``feed`` its bytes as they come, ``end`` when they stop."""

    __slots__ = ("_deflate", "_fed", "_head", "_members", "_trailing", "_wbits", "_z")

    def __init__(self, coding: str) -> None:
        if coding not in CODINGS:
            raise ValueError(f"{coding!r} is not a coding this decodes: {sorted(CODINGS)}")
        self._wbits = CODINGS[coding]
        self._deflate = coding == "deflate"
        self._head = b""
        """The first bytes of a deflate body, held until there are two: they say whether a
        zlib header comes first."""
        self._members = 1
        self._fed = False
        self._trailing = False
        """The body has ended, and bytes that begin no member came after it."""
        self._z: zlib._Decompress | None = (
            None if self._deflate else zlib.decompressobj(self._wbits)
        )

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The body decoded from ``data`` on, piece by piece (the input is taken as the
        pieces are drawn: draw them all before feeding more)."""
        self._fed = self._fed or bool(data)
        z = self._z
        if z is None:  # a deflate body: its first two bytes say which kind
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, b""
            if not _zlib_header(data):  # raw deflate, as some servers send it
                self._wbits = -zlib.MAX_WBITS
            z = self._z = zlib.decompressobj(self._wbits)
        for start in range(0, len(data), PIECE):  # the tail zlib copies stays small
            yield from self._pieces(data[start : start + PIECE])

    def _pieces(self, pending: bytes) -> Iterator[bytes]:
        z = self._z
        assert z is not None  # (feed made it)
        while not self._trailing:
            if z.eof:
                if not pending:
                    return
                if self._deflate or not _GZIP_MAGIC.startswith(pending[:2]):
                    self._trailing = True  # what follows the body: ignored, as gzip(1)
                    return  # and httpx do
                z = self._next_member()
            try:
                piece = z.decompress(pending, PIECE)
            except zlib.error as exc:
                kind = "deflate" if self._deflate else "gzip"
                raise InflateError(f"not valid {kind}: {exc}") from None
            if piece:
                yield piece
            if z.eof:
                pending = z.unused_data
            elif z.unconsumed_tail:
                pending = z.unconsumed_tail
            elif len(piece) == PIECE:  # the decoder may hold more output: ask for it
                pending = b""
            else:
                return

    def _next_member(self) -> zlib._Decompress:
        """A decoder for the gzip member that begins after the last one ended."""
        if self._members == MOST_MEMBERS:
            raise InflateError(f"more than {MOST_MEMBERS} gzip members")
        self._members += 1
        self._z = zlib.decompressobj(self._wbits)
        return self._z

    def end(self) -> None:
        """The body has ended: ``InflateError`` if it ended inside compressed data."""
        if self._fed and (self._z is None or not self._z.eof):
            raise InflateError("the body ended inside its compressed data")


def _zlib_header(data: bytes) -> bool:
    """Whether ``data`` begins with a zlib header (RFC 1950: method 8, a multiple of 31)."""
    return data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
