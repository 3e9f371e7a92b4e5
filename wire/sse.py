"""Server-sent events, sans-IO: bytes in, events out, as the WHATWG HTML standard's
"event stream interpretation" says.

Theory of operation
-------------------
``EventStream.feed(chunk)`` takes whatever bytes arrived (a chunk may end in the
middle of a line, or of a UTF-8 character) and returns the events completed by
them; ``close()`` says the stream ended and returns nothing more (an event not
ended by a blank line is dropped, as the standard says). Lines end in CRLF, LF
or CR; one byte order mark before the first line is ignored; a line starting
with ``:`` is a comment; ``field: value`` (one space
after the colon removed) sets ``event``, appends to ``data`` (joined with
``\\n``), or sets ``id``; other fields (``retry`` too: a reconnecting client's
business) are ignored. An event with no data is not dispatched.

What must hold: the events are the same however the bytes are cut into chunks;
memory is bounded by one line plus one event's data, and ``max_line`` bounds each
(a longer one is ``SSEError``); nothing here reads a socket or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event", "EventStream", "SSEError"]

BOM = "\ufeff".encode()
"""One leading byte order mark is ignored (the standard says so)."""

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

    __slots__ = ("_buffer", "_cr", "_data", "_event", "_head", "_held", "_id", "_max_line")

    def __init__(self, *, max_line: int = MAX_LINE) -> None:
        self._buffer = bytearray()
        self._cr = False
        """The last chunk ended in CR: an LF starting the next one belongs to it."""
        self._data: list[str] = []
        self._held = 0
        """The characters of ``_data``: an event's data is bounded as a line is."""
        self._event = ""
        self._id: str | None = None
        self._max_line = max_line
        self._head: bytes | None = b""
        """The stream's first bytes while they may still be a byte order mark; None past it."""

    def feed(self, chunk: bytes) -> list[Event]:
        """The events the bytes so far complete.

        The lines a chunk completes are decoded and split at once (a line end is one
        ASCII byte, never inside a UTF-8 character), and a ``data:`` line, nearly every
        line of a stream, is read without the general field parse: a stream's events
        cost about what its JSON parse does."""
        if self._head is not None:  # the stream's first bytes: one leading BOM is not text
            chunk = self._head + chunk
            if len(chunk) < len(BOM) and BOM.startswith(chunk):
                self._head = chunk
                return []
            self._head = None
            chunk = chunk.removeprefix(BOM)
        if not chunk:
            return []
        if not (self._buffer or self._cr or self._data or self._event):
            whole = _whole_data_events(chunk, self._id)
            if whole is not None:
                return whole
        if self._cr:  # the last chunk ended in CR: an LF starting this one belongs to it
            self._cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buffer = self._buffer
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end < 0:  # no line ends here
            buffer += chunk
            self._check(buffer)
            return []
        if buffer:
            buffer += chunk[: end + 1]
            done = bytes(buffer)
            buffer.clear()
        else:
            done = chunk[: end + 1]
        if end + 1 < len(chunk):
            buffer += chunk[end + 1 :]
            self._check(buffer)
        self._cr = chunk[-1:] == b"\r"  # its LF, if it has one, comes next
        return self._lines(done)

    @property
    def building(self) -> bool:
        """Whether an event is under way: data held for it, or part of a line that is not
        a comment (what a read of the middle of a long event leaves)."""
        return bool(self._data) or (bool(self._buffer) and self._buffer[:1] != b":")

    def _lines(self, done: bytes) -> list[Event]:
        """The events made by ``done``: whole lines, the last one ended."""
        try:
            text = done.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEError(f"an event-stream line that is not UTF-8: {exc}") from None
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        lines = text.split("\n")
        lines.pop()  # what follows the last line end: nothing
        events: list[Event] = []
        data = self._data
        for line in lines:
            if not line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
                data = self._data
            elif line.startswith("data:"):
                data.append(line[6:] if line[5:6] == " " else line[5:])
                self._hold(len(line))
            else:
                self._field(line)
        return events

    def _hold(self, more: int) -> None:
        """Count ``more`` characters into the event's data: a server that sends data
        lines and never the blank line ending their event held 128 MB in 2,048 lines."""
        self._held += more
        if self._held > self._max_line:
            raise SSEError(f"an event's data longer than {self._max_line} characters")

    def _check(self, buffer: bytearray) -> None:
        if len(buffer) > self._max_line:
            raise SSEError(f"an event-stream line longer than {self._max_line} bytes")

    def close(self) -> list[Event]:
        """The stream ended: a last line without its end still counts; an event not
        ended by a blank line is dropped."""
        if self._buffer:
            self._lines(bytes(self._buffer) + b"\n")
            self._buffer.clear()
        self._data, self._event, self._held = [], "", 0
        return []

    def _field(self, line: str) -> None:
        """A line other than a blank one or a ``data:`` one: a comment or a field."""
        if line[0] == ":":
            return
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._hold(len(value))
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value

    def _dispatch(self) -> Event | None:
        data, event = self._data, self._event
        self._data, self._event, self._held = [], "", 0
        if not data:
            return None
        return _event("\n".join(data), event or "message", self._id)


def _whole_data_events(chunk: bytes, last_id: str | None) -> list[Event] | None:
    """The events of ``chunk`` when it is what a chat stream's chunk nearly always is:
    whole events, each one ``data:`` line and a blank line, LF line ends only (once, or
    a few times when reads fell behind), read with no per-line parse; None for
    anything else, which the general parse then reads. Asked only when the parser
    holds nothing (no partial line, no pending field), so the events are the same."""
    if not chunk.endswith(b"\n\n") or b"\r" in chunk:
        return None
    parts = chunk.split(b"\n\n")
    if parts.pop():  # a third line end at the very end: the general parse reads it
        return None
    events = []
    for part in parts:
        if not part.startswith(b"data:") or b"\n" in part:
            return None  # another field, a comment, several lines, or a stray line end
        value = part[6:] if part[5:6] == b" " else part[5:]
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEError(f"an event-stream line that is not UTF-8: {exc}") from None
        events.append(_event(text, "message", last_id))
    return events


_new = object.__new__
_set_data = Event.__dict__["data"].__set__
_set_event = Event.__dict__["event"].__set__
_set_id = Event.__dict__["id"].__set__


def _event(data: str, event: str, id_: str | None) -> Event:
    """``Event(data=data, event=event, id=id_)``, built through its slots: the frozen
    dataclass's ``__init__`` sets each field with ``object.__setattr__``, several times
    slower, and a stream builds one per token."""
    made: Event = _new(Event)
    _set_data(made, data)
    _set_event(made, event)
    _set_id(made, id_)
    return made
