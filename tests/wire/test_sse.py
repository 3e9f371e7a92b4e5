"""Server-sent events (wire/sse.py, sans-IO): the events are the same however the bytes
are cut, every line ending counts, comments and unknown fields are skipped, and an
event never ended by a blank line is dropped, as the WHATWG standard says."""

from __future__ import annotations

import pytest
from callboard.wire.sse import Event, EventStream, SSEError
from hypothesis import given, settings
from hypothesis import strategies as st

# OpenAI's chat stream as its API reference shows it (abridged), and Anthropic's
# Messages stream with its named events.
OPENAI = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
    b"data: [DONE]\n\n"
)
ANTHROPIC = (
    b"event: message_start\r\n"
    b'data: {"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":25}}}\r\n'
    b"\r\n"
    b'event: ping\r\ndata: {"type": "ping"}\r\n\r\n'
    b": a comment\r\n"
    b"event: content_block_delta\r\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}\r\n'
    b"\r\n"
)


def parse(data: bytes, cuts: list[int] | None = None) -> list[Event]:
    stream, events, at = EventStream(), [], 0
    for cut in sorted(cuts or []):
        events += stream.feed(data[at:cut])
        at = cut
    events += stream.feed(data[at:])
    events += stream.close()
    return events


def test_openais_stream_is_three_data_events() -> None:
    events = parse(OPENAI)
    assert [e.event for e in events] == ["message"] * 3
    assert events[1].data.endswith('"finish_reason":null}]}')
    assert events[2].data == "[DONE]"


def test_anthropics_named_events_with_crlf_and_a_comment() -> None:
    events = parse(ANTHROPIC)
    assert [e.event for e in events] == ["message_start", "ping", "content_block_delta"]
    assert '"text":"Hi"' in events[2].data


@settings(deadline=None)  # pure and quick: a deadline would time the loaded machine, not it
@given(st.lists(st.integers(0, len(ANTHROPIC)), max_size=12))
def test_the_events_do_not_depend_on_how_the_bytes_are_cut(cuts: list[int]) -> None:
    assert parse(ANTHROPIC, cuts) == parse(ANTHROPIC)
    assert parse(OPENAI, [c % (len(OPENAI) + 1) for c in cuts]) == parse(OPENAI)


@settings(deadline=None)
@given(st.lists(st.integers(0, 8), max_size=4))
def test_one_leading_byte_order_mark_is_ignored_however_the_bytes_are_cut(cuts: list[int]) -> None:
    """The standard: "One leading U+FEFF BYTE ORDER MARK character must be ignored";
    the first event (here the first text) must not be lost to it. A second one, or one
    later, is not a byte order mark: the line it starts is an unknown field."""
    bom = "\ufeff".encode()
    assert parse(bom + OPENAI, cuts) == parse(OPENAI)
    twice = parse(bom + bom + OPENAI, cuts)
    assert twice == parse(OPENAI)[1:]


def test_every_line_ending_counts_and_data_lines_join_with_newlines() -> None:
    assert parse(b"data: a\rdata: b\r\n\r\rdata:c\n\n") == [
        Event(data="a\nb"),
        Event(data="c"),
    ]


def test_a_cr_at_the_end_of_a_chunk_and_its_lf_in_the_next_are_one_line_end() -> None:
    assert parse(b"data: x\r\n\r\ndata: y\r\n\r\n", [8]) == [Event(data="x"), Event(data="y")]


def test_id_is_kept_and_unknown_fields_and_empty_events_are_not_dispatched() -> None:
    events = parse(b"id: 7\nretry: 10\nfoo: bar\n\nevent: e\n\ndata: d\n\n")
    assert events == [Event(data="d", id="7")]


def test_an_event_not_ended_by_a_blank_line_is_dropped() -> None:
    assert parse(b"data: whole\n\ndata: cut off") == [Event(data="whole")]


def test_a_line_too_long_or_not_utf8_is_an_error() -> None:
    with pytest.raises(SSEError, match="longer than 8 bytes"):
        EventStream(max_line=8).feed(b"data: 0123456789")
    with pytest.raises(SSEError, match="not UTF-8"):
        EventStream().feed(b"data: \xff\n\n")


@pytest.mark.parametrize("line", [b"data: 0123\n", b"data:0123\n"])
def test_an_events_data_is_bounded_as_a_line_is(line: bytes) -> None:
    """Data lines that never meet the blank line ending their event held 128 MB."""
    stream = EventStream(max_line=32)
    with pytest.raises(SSEError, match="event's data longer than 32"):
        stream.feed(line * 10)
    bounded = EventStream(max_line=32)  # each event alone stays within it
    for _ in range(10):
        assert bounded.feed(line + b"\n") != []


_LINES = st.sampled_from(
    [b'data: {"a":1}', b"data:x", b"data: \xc3\xa9", b"id: 9", b"event: e", b": ping", b"data: "]
)


@settings(deadline=None)
@given(
    st.lists(st.lists(_LINES, min_size=1, max_size=3), max_size=6),
    st.sampled_from([b"\n", b"\r\n"]),
    st.booleans(),
)
def test_a_chunk_of_whole_events_reads_as_the_same_bytes_read_one_at_a_time(
    events: list[list[bytes]], end: bytes, together: bool
) -> None:
    blocks = [end.join(lines) + end + end for lines in events]
    whole, single = EventStream(), EventStream()
    chunks = [b"".join(blocks)] if together else blocks
    got = [e for chunk in chunks for e in whole.feed(chunk)]
    wanted = [e for b in b"".join(blocks) for e in single.feed(bytes([b]))]
    assert got == wanted


def test_whole_data_events_keep_the_last_id_and_refuse_bad_utf8() -> None:
    stream = EventStream()
    assert stream.feed(b"id: 4\n\n") == []
    assert stream.feed(b"data: a\n\ndata:b\n\n") == [
        Event(data="a", id="4"),
        Event(data="b", id="4"),
    ]
    with pytest.raises(SSEError, match="not UTF-8"):
        stream.feed(b"data: \xff\n\n")


def test_an_event_under_way_is_told_from_a_comment() -> None:
    """What the silence cut reads: part of an event is news, a keep-alive comment not."""
    stream = EventStream()
    assert stream.feed(b": keep-al") == []
    assert not stream.building
    assert stream.feed(b"ive\n\n") == []
    assert not stream.building
    assert stream.feed(b'data: {"a"') == []
    assert stream.building
    assert stream.feed(b":1}\n") == []
    assert stream.building  # its data is held until the blank line
    assert stream.feed(b"\n") == [Event(data='{"a":1}')]
    assert not stream.building
