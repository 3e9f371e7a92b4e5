"""Server-sent events, sans-IO: bytes in, events out, as the WHATWG HTML standard's
"event stream interpretation" says.

Theory of operation
-------------------
``EventStream.feed(chunk)`` takes whatever bytes arrived (a chunk may end in the
middle of a line, or of a UTF-8 character) and returns the events completed by
them; ``close()`` says the stream ended and returns nothing more (an event not
ended by a blank line is dropped, as the standard says). Lines end in CRLF, LF
or CR; a line starting with ``:`` is a comment; ``field: value`` (one space
after the colon removed) sets ``event``, appends to ``data`` (joined with
``\\n``), or sets ``id``; other fields (``retry`` too: a reconnecting client's
business) are ignored. An event with no data is not dispatched.

What must hold: the events are the same however the bytes are cut into chunks;
memory is bounded by one line plus one event's data, and ``max_line`` bounds the
line (a longer one is ``SSEError``); nothing here reads a socket or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event", "EventStream", "SSEError"]

MAX_LINE = 16 * 1024 * 1024
"""The longest line accepted (a data line holds one whole JSON event)."""


class SSEError(ValueError):
    """The bytes are not an event stream (a line too long, not UTF-8)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One dispatched event."""

    data: str
    event: str = "message"
    """The ``event:`` field, ``message`` when there was none."""
    id: str | None = None


class EventStream:
    """An incremental parser of one event stream (see the module docstring)."""

    __slots__ = ("_buffer", "_cr", "_data", "_event", "_id", "_max_line")

    def __init__(self, *, max_line: int = MAX_LINE) -> None:
        self._buffer = bytearray()
        self._cr = False
        """The last chunk ended in CR: an LF starting the next one belongs to it."""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._max_line = max_line

    def feed(self, chunk: bytes) -> list[Event]:
        """The events the bytes so far complete."""
        if not chunk:
            return []
        if self._cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._cr = False
        events: list[Event] = []
        buffer = self._buffer
        buffer += chunk
        start = 0
        while True:
            cut = _line_end(buffer, start)
            if cut is None:
                break
            end, after = cut
            if after > len(buffer):  # a CR at the very end: its LF may come next
                self._cr = True
                after = len(buffer)
            event = self._line(bytes(buffer[start:end]))
            if event is not None:
                events.append(event)
            start = after
        del buffer[:start]
        if len(buffer) > self._max_line:
            raise SSEError(f"an event-stream line longer than {self._max_line} bytes")
        return events

    def close(self) -> list[Event]:
        """The stream ended: a last line without its end still counts; an event not
        ended by a blank line is dropped."""
        if self._buffer:
            self._line(bytes(self._buffer))
            self._buffer.clear()
        self._data, self._event = [], ""
        return []

    def _line(self, raw: bytes) -> Event | None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEError(f"an event-stream line that is not UTF-8: {exc}") from None
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> Event | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return Event(data="\n".join(data), event=event or "message", id=self._id)


def _line_end(buffer: bytearray, start: int) -> tuple[int, int] | None:
    """(end of the line, start of the next) for the first line from ``start``, or None
    if it has not ended yet. A CR as the last byte reports ``after`` one past the end."""
    lf = buffer.find(b"\n", start)
    cr = buffer.find(b"\r", start, len(buffer) if lf == -1 else lf)  # no further than the LF
    if cr == -1 or (lf != -1 and lf < cr):
        return None if lf == -1 else (lf, lf + 1)
    if cr + 1 < len(buffer):
        return cr, cr + 2 if buffer[cr + 1] == 0x0A else cr + 1
    return cr, cr + 2  # may be CRLF split across chunks: feed() decides
