"""Bounded, incremental decoding of gzip and deflate bodies."""

from __future__ import annotations

import gzip
import itertools
import zlib

import pytest
from callboard.runtime.inflate import (
    MOST_CODINGS,
    MOST_MEMBERS,
    PIECE,
    Decoder,
    InflateError,
    Inflater,
    coding_of,
    decodes,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


ENCODERS = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    "raw deflate": _raw_deflate,
}


def _decoded(coding: str, body: bytes, cuts: list[int]) -> list[bytes]:
    """``body`` fed to an inflater in parts cut at ``cuts``: every piece it gave."""
    inflater = Inflater("deflate" if coding == "raw deflate" else coding)
    edges = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    pieces: list[bytes] = []
    for start, stop in itertools.pairwise(edges):
        pieces += inflater.feed(body[start:stop])
    inflater.end()
    return pieces


@settings(deadline=None, max_examples=150)
@given(
    coding=st.sampled_from(sorted(ENCODERS)),
    data=st.binary(max_size=3000) | st.integers(0, 400_000).map(lambda n: b"a\n" * n),
    cuts=st.lists(st.integers(0, 10**6), max_size=8),
)
def test_the_pieces_are_the_body_however_its_bytes_came(
    coding: str, data: bytes, cuts: list[int]
) -> None:
    pieces = _decoded(coding, ENCODERS[coding](data), cuts)
    assert b"".join(pieces) == data
    assert all(0 < len(p) <= PIECE for p in pieces)


def test_a_bomb_comes_a_piece_at_a_time() -> None:
    """16 KB of gzip inflating to 16 MB: drawing the first piece decodes one piece, not
    the body (the reader stops at its own bound)."""
    bomb = gzip.compress(b"\n" * 16_000_000, compresslevel=9)
    pieces = Inflater("gzip").feed(bomb)
    first = next(pieces)
    assert len(first) == PIECE
    assert sum(len(p) for p in itertools.islice(pieces, 99)) == 99 * PIECE


def test_members_are_read_one_after_another_up_to_the_most() -> None:
    members = [gzip.compress(b"part %d;" % i) for i in range(MOST_MEMBERS)]
    got = _decoded("gzip", b"".join(members), [5, 40, 41])
    assert b"".join(got) == b"".join(b"part %d;" % i for i in range(MOST_MEMBERS))
    with pytest.raises(InflateError, match=f"more than {MOST_MEMBERS} gzip members"):
        _decoded("gzip", b"".join([*members, gzip.compress(b"one more")]), [])


@pytest.mark.parametrize(
    ("coding", "body", "said"),
    [
        ("gzip", b"not gzip at all", "not valid gzip"),
        ("deflate", b"\x78\x9c not zlib", "not valid deflate"),
        ("gzip", gzip.compress(b"x" * 1000, mtime=0)[:-6], "ended inside"),
        ("gzip", gzip.compress(b"x", mtime=0) + b"\x1f", "ended inside"),
        ("deflate", b"\x78", "ended inside"),
    ],
)
def test_a_body_that_is_not_its_coding_says_so(coding: str, body: bytes, said: str) -> None:
    with pytest.raises(InflateError, match=said):
        _decoded(coding, body, [1, 7])


def test_an_empty_body_is_empty() -> None:
    for coding in ("gzip", "deflate"):
        assert _decoded(coding, b"", []) == []


def test_only_gzip_and_deflate_are_taken() -> None:
    with pytest.raises(ValueError, match="'br' is not a coding"):
        Inflater("br")


@pytest.mark.parametrize(
    ("header", "coding"),
    [
        ("", None),
        ("identity", None),
        (" GZIP ", "gzip"),
        ("identity, deflate", "deflate"),
        ("gzip, br", "gzip, br"),
    ],
)
def test_coding_of_names_the_one_coding_a_header_gives(header: str, coding: str | None) -> None:
    assert coding_of(header) == coding


def test_bytes_after_the_body_that_begin_no_member_are_ignored() -> None:
    """As gzip(1) and httpx's decoders ignore them: a server padding its gzip body with
    zeros failed every answer malformed (found by a review)."""
    assert b"".join(_decoded("gzip", gzip.compress(b"hello", mtime=0) + bytes(4), [])) == b"hello"
    assert b"".join(_decoded("deflate", zlib.compress(b"x") + b"more", [3])) == b"x"


def test_a_large_body_fed_at_once_comes_out_whole() -> None:
    """zlib's unconsumed tail is a copy of what is left: fed a 16 MB body at once, each
    64 KB piece copied the rest (the gateway's request bodies; 7x the time, found by a
    review). zlib now gets at most a piece of input at a time, cut across pieces."""
    data = bytes(range(256)) * (100 * 1024)  # 25 MB, compresses about 100x
    pieces = _decoded("gzip", gzip.compress(data, compresslevel=1, mtime=0), [])
    assert b"".join(pieces) == data


def test_codings_applied_in_turn_are_undone_in_turn_a_piece_at_a_time() -> None:
    """``gzip, gzip`` went whole through httpx's decoders, a read inflated at once: 3 KB
    took 1.6 GB before the reader's bound saw it (found by a hunt)."""
    data = b"[" + b"1," * 200_000 + b"1]"
    body = gzip.compress(zlib.compress(data))  # deflate first, then gzip
    assert b"".join(Decoder("deflate, gzip").feed(body)) == data
    bomb = gzip.compress(gzip.compress(b"\n" * 50_000_000, compresslevel=9), compresslevel=9)
    assert len(bomb) < 100_000
    pieces = Decoder(coding_of("gzip, gzip") or "").feed(bomb)
    assert all(len(p) == PIECE for p in itertools.islice(pieces, 100))
    assert decodes("gzip, deflate")
    assert not decodes("gzip, br")
    assert not decodes(", ".join(["gzip"] * (MOST_CODINGS + 1)))
    decoder = Decoder("gzip, gzip")
    with pytest.raises(InflateError):  # one layer, said two
        list(decoder.feed(gzip.compress(b"once")))
