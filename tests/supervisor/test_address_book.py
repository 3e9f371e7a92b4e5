"""The address book with real pykka actors: live delivery, the hold across a restart,
``fail`` rescuing a dead mailbox in order, bounds, close, many senders racing restarts,
and messages held for an incarnation that fails in ``setup`` reaching the next one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import pykka
import pytest
from callboard.actors.base import CrashPlan
from callboard.messages import Crash
from callboard.provider.server import SimulatedProvider
from callboard.supervisor.address_book import (
    AddressBook,
    AddressBookClosedError,
    AddressError,
    MailboxFullError,
    UnknownActorError,
)
from callboard.supervisor.supervisor import SupervisorConfig
from support import ROUTER_ROUTES, WAIT_S, HoldAtCrash, held_at_crash, one_model, wait_until

from callboard import System, SystemConfig

NAME = "worker"


@dataclass(frozen=True)
class Snapshot:
    """Ask: answer what this incarnation has received so far."""


@dataclass(frozen=True)
class Boom:
    """Tell: raise (a bug). With ``entered``/``release``, first block until released."""

    entered: threading.Event | None = None
    release: threading.Event | None = None


@dataclass
class Journal:
    """What every incarnation received, in order, across incarnations (shared)."""

    entries: list[Any] = field(default_factory=list)
    deaths: dict[str, int] = field(default_factory=dict)
    """actor_urn -> what ``fail`` kept, once that incarnation's ``on_failure`` ran."""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, message: Any) -> None:
        with self.cond:
            self.entries.append(message)
            self.cond.notify_all()

    def died(self, urn: str, kept: int) -> None:
        with self.cond:
            self.deaths[urn] = kept
            self.cond.notify_all()

    def wait_for(self, count: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.entries) >= count, WAIT_S)

    def wait_death(self, ref: pykka.ActorRef[Any]) -> int:
        """Wait until ``ref``'s incarnation has failed; what ``fail`` kept for the next."""
        with self.cond:
            assert self.cond.wait_for(lambda: ref.actor_urn in self.deaths, WAIT_S)
            return self.deaths[ref.actor_urn]


class WorkerCrashError(RuntimeError):
    """What a ``Boom`` raises: the stand-in for a bug in an actor."""


class Worker(pykka.ThreadingActor):
    """Records what it receives; on a ``Boom`` it crashes and hands its mailbox to the book."""

    use_daemon_thread = True

    def __init__(self, book: AddressBook, journal: Journal, first: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.book = book
        self.journal = journal
        self.first = list(first)
        self.mine: list[Any] = []

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, Snapshot):
            return list(self.mine)
        if isinstance(message, Boom):
            if message.entered is not None and message.release is not None:
                message.entered.set()
                message.release.wait(WAIT_S)
            raise WorkerCrashError("boom (a test crash)")
        self.mine.append(message)
        self.journal.add(message)
        return None

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.journal.died(self.actor_urn, self.book.fail(NAME, self.actor_ref, self.first))


Start = Callable[..., "pykka.ActorRef[Worker]"]


@pytest.fixture
def start() -> Iterator[Start]:
    refs: list[pykka.ActorRef[Worker]] = []

    def start(book: AddressBook, journal: Journal, first: tuple[Any, ...] = ()) -> Any:
        ref = Worker.start(book, journal, first)
        refs.append(ref)
        return ref

    yield start
    for ref in refs:
        ref.stop(block=True, timeout=WAIT_S)


def snapshot(ref: pykka.ActorRef[Worker]) -> list[Any]:
    answer: list[Any] = ref.ask(Snapshot(), timeout=WAIT_S)
    return answer


# -- delivery ---------------------------------------------------------------------


def test_tell_reaches_a_registered_actor_in_order(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    book.add(NAME)
    ref = start(book, journal)
    book.register(NAME, ref)
    assert book.resolve(NAME) is ref
    for i in range(50):
        book.tell(NAME, i)
    assert snapshot(ref) == list(range(50))
    assert book.take_held(NAME) == []


def test_messages_are_held_until_register_then_delivered_in_order(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    book.add(NAME)
    assert book.names() == [NAME]
    assert book.resolve(NAME) is None
    for i in range(10):
        book.tell(NAME, i)
    ref = start(book, journal)
    book.register(NAME, ref)
    book.tell(NAME, 10)  # after register: straight to the actor, behind the held ones
    assert snapshot(ref) == list(range(11))
    assert book.take_held(NAME) == []


def test_unknown_names_are_refused() -> None:
    book = AddressBook()
    with pytest.raises(UnknownActorError, match="nobody") as info:
        book.tell("nobody", "x")
    assert isinstance(info.value, KeyError)
    book.try_tell("nobody", "x")  # refused, not raised
    assert book.resolve("nobody") is None
    assert book.detach("nobody") is None
    assert book.take_held("nobody") == []


def test_a_ref_that_died_without_fail_makes_tell_hold_instead(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    old = start(book, journal)
    book.register(NAME, old)
    assert old.stop(block=True, timeout=WAIT_S)
    book.tell(NAME, "after death")  # no ActorDeadError reaches the sender
    assert book.resolve(NAME) is None
    new = start(book, journal)
    book.register(NAME, new)
    assert snapshot(new) == ["after death"]


def test_register_of_a_dead_ref_keeps_the_messages_held(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    book.add(NAME)
    book.tell(NAME, "a")
    book.tell(NAME, "b")
    dead = start(book, journal)
    dead.stop(block=True, timeout=WAIT_S)
    book.register(NAME, dead)
    assert book.resolve(NAME) is None
    live = start(book, journal)
    book.register(NAME, live)
    assert snapshot(live) == ["a", "b"]


def test_detach_starts_holding_and_returns_the_old_ref(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    old = start(book, journal)
    book.register(NAME, old)
    book.tell(NAME, "to old")
    assert book.detach(NAME) is old
    assert book.resolve(NAME) is None
    assert book.detach(NAME) is None
    book.tell(NAME, "held 1")
    book.tell(NAME, "held 2")
    assert snapshot(old) == ["to old"]
    new = start(book, journal)
    book.register(NAME, new)
    assert snapshot(new) == ["held 1", "held 2"]


def test_take_held_empties_the_hold() -> None:
    book = AddressBook()
    book.add(NAME)
    book.tell(NAME, 1)
    book.tell(NAME, 2)
    assert book.take_held(NAME) == [1, 2]
    assert book.take_held(NAME) == []


# -- fail: a dead mailbox is rescued ---------------------------------------------


def test_fail_hands_the_dead_mailbox_to_the_next_incarnation_in_order(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    book.add(NAME)
    old = start(book, journal, first=("redo",))
    book.register(NAME, old)
    book.tell(NAME, "before")
    entered, release = threading.Event(), threading.Event()
    book.tell(NAME, Boom(entered, release))
    assert entered.wait(WAIT_S), "the actor is now busy on the message that will crash it"
    book.tell(NAME, "q1")
    question = old.ask("are you there?", block=False)
    book.tell(NAME, "q2")
    stop_reply = old.stop(block=False)  # a stop request in the dead mailbox is answered too
    book.tell(NAME, "q3")
    release.set()

    assert journal.wait_death(old) == 4, "'redo' plus the three tells behind the crash"
    with pytest.raises(pykka.ActorDeadError):
        question.get(timeout=WAIT_S)
    assert stop_reply.get(timeout=WAIT_S) is False  # pykka's answer: it was dead already
    assert book.resolve(NAME) is None

    book.tell(NAME, "while restarting")  # held behind the rescued messages
    new = start(book, journal)
    book.register(NAME, new)
    book.tell(NAME, "after")
    assert snapshot(new) == ["redo", "q1", "q2", "q3", "while restarting", "after"]
    assert journal.entries == ["before", "redo", "q1", "q2", "q3", "while restarting", "after"]


def test_fail_by_a_stale_incarnation_changes_nothing(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    stale, current = start(book, journal), start(book, journal)
    book.register(NAME, current)
    stale.tell("in the stale mailbox")
    assert book.fail(NAME, stale, ["first"]) == 0
    assert book.resolve(NAME) is current
    assert book.take_held(NAME) == []
    assert snapshot(stale) == ["in the stale mailbox"]


def test_fail_for_an_unknown_name_does_nothing(start: Start) -> None:
    book = AddressBook()
    ref = start(book, Journal())
    assert book.fail("nobody", ref, ["x"]) == 0
    assert book.names() == []


def test_fail_keeps_rescued_messages_even_past_the_hold_bound(start: Start) -> None:
    """The bound refuses new tells; it never drops messages already told."""
    book, journal = AddressBook(max_held=2), Journal()
    book.add(NAME)
    old = start(book, journal)
    book.register(NAME, old)
    entered, release = threading.Event(), threading.Event()
    book.tell(NAME, Boom(entered, release))
    assert entered.wait(WAIT_S)
    for i in range(5):
        book.tell(NAME, i)
    release.set()
    assert journal.wait_death(old) == 5
    with pytest.raises(MailboxFullError):
        book.tell(NAME, "one too many")
    new = start(book, journal)
    book.register(NAME, new)
    assert snapshot(new) == [0, 1, 2, 3, 4]


# -- bounds and close -------------------------------------------------------------


def test_the_hold_is_bounded_with_a_typed_error() -> None:
    book = AddressBook(max_held=3)
    book.add(NAME)
    for i in range(3):
        book.tell(NAME, i)
    with pytest.raises(MailboxFullError, match=NAME) as info:
        book.tell(NAME, 3)
    assert isinstance(info.value, AddressError)
    book.try_tell(NAME, 3)  # refused, not raised
    assert book.take_held(NAME) == [0, 1, 2], "nothing was silently dropped or added"


def test_after_close_every_tell_is_refused(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    ref = start(book, journal)
    book.register(NAME, ref)
    book.add("restarting")
    assert not book.closed
    book.close()
    assert book.closed
    for name in (NAME, "restarting", "nobody"):
        with pytest.raises(AddressBookClosedError):
            book.tell(name, "late")
        book.try_tell(name, "late")  # refused, not raised
    assert snapshot(ref) == []
    assert book.take_held("restarting") == []


def test_try_tell_delivers_like_tell_while_open(start: Start) -> None:
    book, journal = AddressBook(), Journal()
    ref = start(book, journal)
    book.register(NAME, ref)
    book.try_tell(NAME, "x")
    assert snapshot(ref) == ["x"]


# -- many senders, repeated crashes -----------------------------------------------


def test_every_message_arrives_once_in_sender_order_across_crashes(start: Start) -> None:
    """Senders tell in rounds; in each round the actor crashes and restarts mid-stream, so
    tells land in the dead mailbox (rescued by ``fail``), race the death (``ActorDeadError``
    inside ``tell``), wait in the hold, or reach the next incarnation directly."""
    book, journal = AddressBook(), Journal()
    book.add(NAME)
    senders, rounds, chunk = 6, 25, 300
    ref = start(book, journal)
    book.register(NAME, ref)
    round_start = threading.Barrier(senders + 1)

    def send(sender: int) -> None:
        for r in range(rounds):
            round_start.wait(WAIT_S)
            for seq in range(r * chunk, (r + 1) * chunk):
                book.tell(NAME, (sender, seq))

    with ThreadPoolExecutor(max_workers=senders) as pool:
        running = [pool.submit(send, s) for s in range(senders)]
        for _ in range(rounds):
            entered, release = threading.Event(), threading.Event()
            book.tell(NAME, Boom(entered, release))  # crashes the incarnation, in message order
            assert entered.wait(WAIT_S)
            round_start.wait(WAIT_S)  # senders now tell into the mailbox behind the crash
            release.set()
            journal.wait_death(ref)
            ref = start(book, journal)
            book.register(NAME, ref)
        for r in running:
            r.result(WAIT_S)

    total = senders * rounds * chunk
    assert journal.wait_for(total), f"only {len(journal.entries)} of {total} arrived"
    snapshot(ref)  # everything told before this has been handled
    assert len(journal.entries) == total, "nothing delivered twice"
    for sender in range(senders):
        got = [seq for s, seq in journal.entries if s == sender]
        assert got == list(range(rounds * chunk)), f"sender {sender}: lost, duplicated or reordered"
    assert book.take_held(NAME) == []


def test_a_tell_racing_close_is_either_held_before_it_or_refused() -> None:
    book = AddressBook()
    book.add("a")  # no incarnation: every tell is held
    told: list[int] = []
    refused: list[int] = []
    started = threading.Event()

    def teller() -> None:
        for i in range(2000):
            try:
                book.tell("a", i)
            except AddressBookClosedError:
                refused.append(i)
                return
            told.append(i)
            started.set()

    thread = threading.Thread(target=teller)
    thread.start()
    assert started.wait(5.0)
    book.close()
    held = book.take_held("a")
    thread.join(5.0)
    assert held == told  # nothing was held after take_held could see it
    assert refused or len(told) == 2000


# -- a hold handed across a failed start ---------------------------------------------------


SHORT_S = 3.0
"""Upper bound for any wait here: each test stays well under 5 s."""


def registered(system: System, dying: Any) -> bool:
    """The router's failed incarnation ``dying`` was handed the hold (the bug) or refused it
    (the fix)."""
    entry = system.book._entries["router"]
    return system.book.resolve("router") is dying or entry.died_unregistered is not dying


def test_messages_held_for_an_incarnation_that_fails_in_setup_reach_the_next(
    provider: SimulatedProvider,
) -> None:
    plan = CrashPlan({}, fail_starts={"router": 1})
    config = SystemConfig(
        models=(one_model(provider),),
        supervisor=SupervisorConfig(
            backoff_min_s=0.2, backoff_max_s=0.2, backoff_jitter=0.0, liveness_every_s=0.0
        ),
        budget=ROUTER_ROUTES,  # the task's Route goes to the router (held), not the queue
    )
    # router #2's failed start is held after its book hand-over until the supervisor
    # has registered it and handed it the hold
    hold = HoldAtCrash("router", 2, "crashed while starting", until=registered)
    with held_at_crash(hold, config, plan) as system:
        system.tell("router", Crash(reason="down for 0.2 s"))
        assert wait_until(lambda: system.book.resolve("router") is None)
        future = system.submit("x")  # its Route is held for router #2, whose start fails
        assert hold.held.wait(SHORT_S)  # the race was provoked
        result = future.result(2.0)  # correct: router #3 gets it, it completes
        assert result.ok
