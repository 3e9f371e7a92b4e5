"""The address book: actor name -> current ActorRef, stable across restarts.

Senders never keep an ``ActorRef``; they ``tell`` a name. While an actor is
restarting its entry has no ref and messages for it are held, in order, and
handed to the new incarnation when it registers. A failing actor moves the
messages still in its dead mailbox into the hold (``fail``), under the same
per-name lock every sender takes, so no message can slip into a dead mailbox
after the drain: nothing told through the book is ever silently dropped.

What must hold: per name, messages reach the actor in the order they were
told; the hold is bounded (``MailboxFullError`` past the bound, never silent loss);
after ``close`` every tell is refused with ``AddressBookClosedError``.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pykka
from callboard.runtime.guarded_log import guarded_logger

log = guarded_logger(__name__)


class AddressError(Exception):
    """A tell that could not be accepted."""


class UnknownActorError(AddressError, KeyError):
    """No actor of that name is known."""


class AddressBookClosedError(AddressError):
    """The system is shut down: nothing more is delivered."""


class MailboxFullError(AddressError):
    """An actor has been restarting for so long that its hold is full."""


@dataclass(slots=True)
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ref: pykka.ActorRef[Any] | None = None
    held: deque[Any] = field(default_factory=deque)
    died_unregistered: pykka.ActorRef[Any] | None = None
    """An incarnation that failed (in its setup) before it was registered: its
    ``register``, when it comes, must not hand it what is held."""


class AddressBook:
    """Thread-safe; ``tell`` costs one uncontended lock plus pykka's tell."""

    def __init__(self, *, max_held: int = 1_000_000) -> None:
        self._entries: dict[str, _Entry] = {}
        self._max_held = max_held
        self._closed = False

    def add(self, name: str) -> None:
        """Declare a name; messages told to it are held until ``register``."""
        self._entries.setdefault(name, _Entry())

    def names(self) -> list[str]:
        return list(self._entries)

    def tell(self, name: str, message: Any) -> None:
        if self._closed:
            raise AddressBookClosedError(f"cannot send to {name!r}: the system is stopped")
        try:
            entry = self._entries[name]
        except KeyError:
            raise UnknownActorError(f"no actor named {name!r}") from None
        with entry.lock:
            ref = entry.ref
            if ref is not None:
                try:
                    ref.tell(message)
                except pykka.ActorDeadError:
                    entry.ref = None
                else:
                    return
            if self._closed:  # closed meanwhile: nobody will take what is held now
                raise AddressBookClosedError(f"cannot send to {name!r}: the system is stopped")
            if len(entry.held) >= self._max_held:
                raise MailboxFullError(f"{name!r} is restarting and {self._max_held} messages wait")
            entry.held.append(message)

    def try_tell(self, name: str, message: Any) -> bool:
        """``tell`` for timers and late callbacks: a refusal (after close, a mailbox full
        while its actor restarts) is not raised; False says there was one."""
        try:
            self.tell(name, message)
        except AddressError:
            return False
        return True

    def resolve(self, name: str) -> pykka.ActorRef[Any] | None:
        """The current ref (for ``ask`` at the edges); None while restarting."""
        entry = self._entries.get(name)
        return None if entry is None else entry.ref

    def register(self, name: str, ref: pykka.ActorRef[Any]) -> None:
        """Install a (new) incarnation and hand it the held messages, in order."""
        entry = self._entries.setdefault(name, _Entry())
        with entry.lock:
            if entry.died_unregistered is ref:  # its setup failed first: the next gets them
                entry.died_unregistered = None
                return
            held, entry.held = list(entry.held), deque()
            for i, message in enumerate(held):
                try:
                    ref.tell(message)
                except pykka.ActorDeadError:  # died while starting: keep the rest held
                    entry.held.extend(held[i:])
                    return
            entry.ref = ref

    def fail(self, name: str, ref: pykka.ActorRef[Any], first: list[Any]) -> int:
        """A dying incarnation hands over ``first`` and what is left in its mailbox.

        Called on the dying actor's own thread. Does nothing if ``ref`` is no
        longer the registered incarnation. Returns how many messages were kept.
        """
        entry = self._entries.get(name)
        if entry is None:
            return 0
        with entry.lock:
            if entry.ref is not None and entry.ref is not ref:
                return 0
            if entry.ref is None:  # not registered yet (it failed in setup): never will be
                entry.died_unregistered = ref
            entry.ref = None
            rescued = list(first)
            rescued.extend(_drain(ref.actor_inbox))
            entry.held.extendleft(reversed(rescued))
            return len(rescued)

    def detach(self, name: str) -> pykka.ActorRef[Any] | None:
        """Start holding messages for ``name`` and return the ref it had (to stop it)."""
        entry = self._entries.get(name)
        if entry is None:
            return None
        with entry.lock:
            ref, entry.ref = entry.ref, None
            return ref

    def take_held(self, name: str) -> list[Any]:
        """Remove and return what is held for ``name`` (shutdown: to fail it cleanly)."""
        entry = self._entries.get(name)
        if entry is None:
            return []
        with entry.lock:
            held, entry.held = list(entry.held), deque()
            return held

    def close(self) -> None:
        """Refuse every tell from now on. Returns once no tell is still holding a message
        it began before, so ``take_held`` afterwards sees everything ever held."""
        self._closed = True
        for entry in list(self._entries.values()):
            with entry.lock:  # waits out a tell that passed the first closed check
                pass

    @property
    def closed(self) -> bool:
        return self._closed


def _drain(inbox: Any) -> list[Any]:
    """Messages left in a dead pykka mailbox: tells are kept, asks are failed.

    A stop is an ask too (``ActorRef.stop``): failing it with ``ActorDeadError``
    is what pykka answers a stop of an actor that is dead already (``stop``
    returns False), which this one is.
    """
    kept: list[Any] = []
    while True:
        try:
            envelope = inbox.get_nowait()
        except queue.Empty:
            return kept
        if envelope.reply_to is None:
            kept.append(envelope.message)
        else:
            envelope.reply_to.set_exception(
                exc_info=(pykka.ActorDeadError, pykka.ActorDeadError("actor restarting"), None)
            )
