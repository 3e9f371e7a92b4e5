"""The cluster's one queue (``cluster/_queue.py``) as a plain object on an event loop:
the class its Ray actor runs, driven through the methods processes and model actors
call, a model's handle standing in for the model actor (it records each batch sent).
The queue with real model actors and systems is in ``test_model.py`` and
``test_assembly.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time

import pytest
from callboard.cluster import _queue
from callboard.cluster._queue import EPOCH, QueueShell
from callboard.cluster._wire import Ticket
from callboard.core.pqueue import AGED_RANK, TaskQueue
from callboard.core.settings import SchedulerSettings
from callboard.messages import Priority, Request
from callboard.runtime.codec import request_to_json


class _Model:
    """A model actor's handle: records the tickets of each ``call`` the queue sends."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.ranks: list[list[int]] = []
        self.waiting: list[int | None] = []
        """What each batch said still waits for the model (None: not said)."""
        self.call = self

    def remote(
        self,
        incarnation: int,
        tickets: list[Ticket],
        ranks: list[int],
        displacing: bool = False,
        waiting: int | None = None,
    ) -> None:
        self.batches.append([t.task_id for t in tickets])
        self.ranks.append(ranks)
        self.waiting.append(waiting)


def _ticket(owner: int, task_id: int, priority: Priority = Priority.NORMAL) -> Ticket:
    return Ticket(
        owner=owner,
        task_id=task_id,
        attempt=0,
        priority=int(priority),
        arrival=time.time(),
        deadline=None,
        lanes=("m",),
        tenant=None,
        cost=20,
        trace_id=f"t{task_id}",
        request=request_to_json(Request.of(f"task {task_id}", max_tokens=8)),
        prompt_tokens=4,
    )


def test_a_ticket_the_queue_cannot_take_is_told_its_owner_and_its_batch_still_goes() -> None:
    # a ticket another version wrote (a tenant that is not a name) between two good ones:
    # the batch stopped at it, the first waited with credits free, and the owner of the
    # bad one was never told, so its task never ended (found by a hunt)
    async def scenario() -> None:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _Model()
        owner, _ = await queue.register("a process")
        await queue.ready("m", 1, 3, model)
        bad = dataclasses.replace(_ticket(owner, 2), tenant=7)  # type: ignore[arg-type]
        await queue.enqueue([_ticket(owner, 1), bad, _ticket(owner, 3)])
        assert sorted(t for batch in model.batches for t in batch) == [1, 3]
        news = await asyncio.wait_for(queue.collect(owner, 5.0), timeout=5.0)
        assert [task_id for task_id, _ in news.invalid] == [2]
        assert "TypeError" in news.invalid[0][1]
        assert "tenant" in news.invalid[0][1]
        assert (await queue.state())["waiting"] == 0

    asyncio.run(scenario())


def test_a_model_is_told_how_many_tickets_for_it_still_wait_in_the_queue() -> None:
    # what keeps a model from lending its spare slots to processes (``cluster._lease``)
    # while tickets wait for it here: each batch and each grant's answer says
    async def scenario() -> None:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _Model()
        owner, _ = await queue.register("a process")
        await queue.enqueue([_ticket(owner, i) for i in range(1, 5)])
        assert await queue.ready("m", 1, 3, model) == (queue.incarnation, 1)
        assert (model.batches, model.waiting) == ([[1, 2, 3]], [1])
        assert await queue.ready("m", 1, 2, model) == (queue.incarnation, 0)
        assert (model.batches[-1], model.waiting[-1]) == ([4], 0)
        await queue.enqueue([_ticket(owner, 5)])  # a credit left: sent at once
        assert (model.batches[-1], model.waiting[-1]) == ([5], 0)

    asyncio.run(scenario())


class _OlderModel(_Model):
    """A model actor of an older callboard: its ``call`` takes no ``waiting`` (Ray
    refuses a call with more arguments at once, as this does)."""

    def remote(self, incarnation: int, tickets: list[Ticket], ranks: list[int]) -> None:  # type: ignore[override]
        super().remote(incarnation, tickets, ranks)


def test_a_model_actor_of_an_older_callboard_still_gets_its_batches() -> None:
    async def scenario() -> None:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _OlderModel()
        owner, _ = await queue.register("a process")
        await queue.ready("m", 1, 2, model)
        await queue.enqueue([_ticket(owner, 1), _ticket(owner, 2)])
        assert model.batches == [[1, 2]]
        assert (await queue.state())["waiting"] == 0

    asyncio.run(scenario())


def test_a_ticket_a_model_hands_back_keeps_its_place() -> None:
    """A model whose limiter says "not yet" hands its tickets back; one went behind every
    ticket waiting at its priority, again each time (under a binding rate limit the
    second task submitted was answered last: found by a hunt)."""

    async def scenario() -> None:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _Model()
        owner, _ = await queue.register("a process")
        now = time.time()
        tickets = [  # a millisecond apart: in one aging window (10 s), whatever the clock
            dataclasses.replace(_ticket(owner, i), arrival=now + i / 1000) for i in range(1, 5)
        ]
        await queue.enqueue(tickets)
        await queue.ready("m", 1, 1, model)
        assert model.batches == [[1]]
        await queue.back([tickets[0]], "m", 1, None)  # not yet, says its limiter
        await queue.ready("m", 1, 1, model)
        assert model.batches == [[1], [1]], "it waits first, as it did"

    asyncio.run(scenario())


def test_the_queue_ranks_a_ticket_as_its_core_orders_it() -> None:
    # the rank sent with each ticket (what a model compares held tickets by) is the
    # core's: tickets popped from the core come in the order their ranks say
    rng = random.Random(5)
    settings = SchedulerSettings()
    shell = QueueShell(settings, lease_s=30.0)
    core: TaskQueue[Ticket] = TaskQueue(  # no aged turns: the turns follow the ranks
        capacity=1000, aging_step_s=settings.aging_step_s, aging_share=0.001, epoch=EPOCH
    )
    now = time.time()
    tickets = [
        dataclasses.replace(
            _ticket(1, i, Priority(rng.randrange(4))),
            arrival=now - rng.uniform(0, 60),
            deadline=rng.choice([None, now + rng.uniform(1, 100)]),
        )
        for i in range(300)
    ]
    for t in sorted(tickets, key=lambda t: t.arrival):  # pushed as they came: seq is arrival
        core.push(
            t.key,
            t,
            priority=t.priority,
            candidates=t.lanes,
            arrival=t.arrival,
            deadline=t.deadline,
        )
    popped, _ = core.pop_for("m", now, len(tickets))
    orders = [t.order(shell._rank(t)) for t in popped]
    assert orders == sorted(orders)


def test_processes_that_died_leave_nothing_in_the_queue_for_good() -> None:
    # each process ever registered stayed in the queue's names (and, if it died with
    # tickets waiting, in its lapsed set) for the queue's whole life (found by a hunt)
    clock = [1000.0]  # the queue's lease clock

    async def scenario() -> None:
        queue = QueueShell(SchedulerSettings(), lease_s=30.0, clock=lambda: clock[0])
        dead = [(await queue.register(f"process {i}"))[0] for i in range(50)]
        await queue.enqueue([_ticket(owner, 1) for owner in dead])
        clock[0] += 31.0  # past their lease
        survivor, _ = await queue.register("survivor")
        await queue.collect(survivor, 0.0)  # its poll sweeps the dead
        assert (await queue.state())["owners"] == [survivor]
        assert queue._names == {"survivor": survivor}
        back = await queue.collect(dead[0], 0.0)  # one that was only asleep: told
        assert back.lapsed
        assert (await queue.register("process 1"))[0] not in dead  # no number given twice
        clock[0] += _queue.LAPSED_KEEP_S + 1.0
        await queue.collect(survivor, 0.0)
        assert not queue._lapsed

    asyncio.run(scenario())


def test_a_ticket_taken_on_an_aged_turn_keeps_its_held_place_against_newcomers() -> None:
    """The ticket an aged turn took is the model's next call; ranked by the static order,
    each CRITICAL newcomer displaced it, and handed back it had to earn its turn again:
    never called in 300 calls (found by a review). It goes ranked ahead of all."""

    async def scenario() -> None:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _Model()
        owner, _ = await queue.register("a process")
        aged = dataclasses.replace(_ticket(owner, 1, Priority.LOW), arrival=time.time() - 60)
        urgent = [_ticket(owner, i, Priority.CRITICAL) for i in range(2, 22)]
        await queue.enqueue([aged, *urgent])
        for _ in range(10):  # one turn in ten (aging_share 0.1) is the aged ticket's
            await queue.ready("m", 1, 1, model)
        assert model.batches == [[i] for i in range(2, 11)] + [[1]]
        assert model.ranks[-1] == [AGED_RANK]
        await queue.enqueue([_ticket(owner, 99, Priority.CRITICAL)])  # finds no credit
        assert len(model.batches) == 10, "the newcomer took the aged ticket's place"
        assert (await queue.state())["displaced"] == 0

    asyncio.run(scenario())


def test_a_process_that_died_alone_is_not_called_for_past_its_lease() -> None:
    """Its lease was looked at only in polls: with no other process polling, its
    waiting tickets went to the model as it granted, each a call for nobody (20 calls
    past its lease; found by a hunt)."""
    clock = [1000.0]  # the queue's lease clock

    async def scenario() -> None:
        queue, model = (
            QueueShell(SchedulerSettings(), lease_s=30.0, clock=lambda: clock[0]),
            _Model(),
        )
        owner, _ = await queue.register("a process")
        await queue.enqueue([_ticket(owner, i) for i in range(1, 6)])
        await queue.ready("m", 1, 1, model)
        assert model.batches == [[1]]
        clock[0] += 29.0  # within its lease: served as ever
        await queue.ready("m", 1, 1, model)
        assert model.batches == [[1], [2]]
        clock[0] += 2.0  # past it, nobody having polled
        await queue.ready("m", 1, 3, model)
        assert model.batches == [[1], [2]]
        assert (await queue.state())["waiting"] == 0
        assert (await queue.collect(owner, 0.0)).lapsed  # only asleep: told, it sends again

    asyncio.run(scenario())


def test_a_process_that_takes_a_ledger_over_drops_what_its_holder_left_waiting() -> None:
    """A process killed and resumed from its ledger at once: its tickets waited out
    its lease, each called as the successor sent its task again, every queued task
    called twice (found by a hunt). The successor drops them at once; another
    process's tickets, and the successor's own, stay."""

    async def scenario() -> None:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _Model()
        killed, _ = await queue.register("killed")
        other, _ = await queue.register("another process")
        assert await queue.succeed(killed, "ledger-1") == 0  # its first holder
        await queue.enqueue([_ticket(killed, i) for i in range(1, 6)])
        await queue.enqueue([_ticket(other, 10)])
        heir, _ = await queue.register("its successor")
        assert await queue.succeed(heir, "ledger-1") == 5
        assert await queue.succeed(heir, "ledger-1") == 0  # told again: nothing more
        await queue.enqueue([_ticket(heir, 1)])
        await queue.ready("m", 1, 10, model)
        assert sorted(model.batches[0]) == [1, 10]
        assert model.batches[0].count(1) == 1  # the successor's, not the dead holder's
        assert (await queue.state())["owners"] == sorted([other, heir])
        assert (await queue.collect(killed, 0.0)).lapsed  # if it was not dead: told

    asyncio.run(scenario())


def test_an_owner_that_enqueues_is_heard_from() -> None:
    """Tickets sent after a lease's length without a poll (a slow poll, a stalled
    process back) go on: their owner is evidently alive."""
    clock = [1000.0]  # the queue's lease clock

    async def scenario() -> None:
        queue, model = (
            QueueShell(SchedulerSettings(), lease_s=30.0, clock=lambda: clock[0]),
            _Model(),
        )
        owner, _ = await queue.register("a process")
        clock[0] += 31.0  # registered, never polled
        await queue.enqueue([_ticket(owner, 1)])
        await queue.ready("m", 1, 1, model)
        assert model.batches == [[1]]

    asyncio.run(scenario())


def test_a_ticket_handed_back_after_its_owner_was_taken_for_dead_is_dropped() -> None:
    """A model hands back a ticket it could not start (its limiter said not yet); its
    owner had been swept meanwhile: the ticket brought the owner back to life, a new
    lease and all, and was called for nobody (a review)."""
    clock = [1000.0]  # the queue's lease clock

    async def scenario() -> None:
        queue, model = (
            QueueShell(SchedulerSettings(), lease_s=30.0, clock=lambda: clock[0]),
            _Model(),
        )
        owner, _ = await queue.register("a process")
        await queue.enqueue([_ticket(owner, i) for i in range(1, 4)])
        await queue.ready("m", 1, 1, model)
        assert model.batches == [[1]]
        other, _ = await queue.register("another process")
        clock[0] += 31.0  # the first died; the other's poll sweeps it
        await queue.collect(other, 0.0)
        await queue.back([_ticket(owner, 1)], "m", 1, None)
        await queue.ready("m", 1, 3, model)
        assert model.batches == [[1]]
        assert (await queue.state())["owners"] == [other]

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["with the next grant", "on their own"])
def test_calls_charged_more_than_they_used_are_settled_to_their_tenant(how: str) -> None:
    """B's tickets are charged 1010 tokens (a long ``max_tokens``), A's 20, and each
    call uses 20: settled, the two alternate; unsettled, B got one turn in twelve."""

    async def scenario(settling: bool) -> int:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _Model()
        owner, _ = await queue.register("a process")
        a = [dataclasses.replace(_ticket(owner, i), tenant="A", cost=20) for i in range(1, 21)]
        b = [dataclasses.replace(_ticket(owner, i), tenant="B", cost=1010) for i in range(21, 31)]
        await queue.enqueue(a + b)
        settled: tuple[tuple[int, str | None, int], ...] = ()
        for _ in range(12):
            await queue.ready("m", 1, 1, model, settled=settled)
            (task_id,) = model.batches[-1]
            settled = ((int(Priority.NORMAL), "B", 990),) if settling and task_id > 20 else ()
            if how == "on their own" and settled:
                await queue.settle("m", settled)
                settled = ()
        return sum(task_id > 20 for batch in model.batches for task_id in batch)

    assert asyncio.run(scenario(settling=False)) == 1
    assert asyncio.run(scenario(settling=True)) == 6


def test_a_ticket_handed_back_unsent_is_not_charged_to_its_tenant() -> None:
    """Each of A's tickets is handed back once ("not yet", says the model's limiter)
    before its call goes: A and B still alternate. Its charge at the grant had stood,
    so A paid twice for each call and got four turns in twelve."""

    async def scenario() -> int:
        queue, model = QueueShell(SchedulerSettings(), lease_s=30.0), _Model()
        owner, _ = await queue.register("a process")
        tickets = {
            i: dataclasses.replace(_ticket(owner, i), tenant="A" if i <= 20 else "B")
            for i in range(1, 41)
        }
        await queue.enqueue(list(tickets.values()))
        handed_back: set[int] = set()
        served: list[int] = []
        while len(served) < 12:
            await queue.ready("m", 1, 1, model)
            (task_id,) = model.batches[-1]
            if task_id <= 20 and task_id not in handed_back:
                handed_back.add(task_id)
                await queue.back([tickets[task_id]], "m", 1, None)
            else:
                served.append(task_id)
        return sum(task_id <= 20 for task_id in served)

    assert asyncio.run(scenario()) == 6


def test_a_wall_clock_step_neither_stretches_nor_cuts_a_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Leases were measured on the wall clock: stepped back an hour (NTP), a process
    that had died was still called for an hour (found by a hunt). They run on the
    queue's monotonic clock; a step of the wall clock changes nothing of them."""
    lease = [1000.0]
    wall = [time.time()]
    monkeypatch.setattr(_queue.time, "time", lambda: wall[0])

    async def scenario() -> None:
        queue = QueueShell(SchedulerSettings(), lease_s=30.0, clock=lambda: lease[0])
        model = _Model()
        owner, _ = await queue.register("a process")
        await queue.enqueue([_ticket(owner, i) for i in range(1, 6)])
        await queue.ready("m", 1, 1, model)
        wall[0] += 3600.0  # forward: no lease ran out
        await queue.ready("m", 1, 1, model)
        assert model.batches == [[1], [2]]
        wall[0] -= 7200.0  # back: none runs longer
        lease[0] += 31.0
        await queue.ready("m", 1, 3, model)
        assert model.batches == [[1], [2]]
        assert (await queue.state())["waiting"] == 0

    asyncio.run(scenario())


def test_a_ticket_that_displaced_another_is_not_refunded_when_it_comes_back() -> None:
    """A ticket sent to displace a model's held one was taken out uncharged; handed
    back, its cost was refunded anyway, undoing a charge of another of its tenant's
    calls: A went twice in a row (found by a review). Only a charged grant is undone."""

    async def scenario(hand_back: bool) -> str:
        settings = SchedulerSettings()
        queue, model = QueueShell(settings, lease_s=30.0), _Model()
        owner, _ = await queue.register("a process")
        step = settings.aging_step_s
        assert step is not None
        # every arrival below in one aging window: the urgent ticket, half a second on,
        # ranked a window later when a boundary fell between, and displaced nothing
        # (one run in twenty; found by a hunt)
        now = math.floor(time.time() / step) * step + 1.0
        tickets = [
            dataclasses.replace(
                _ticket(owner, i), tenant="A" if i <= 20 else "B", arrival=now + i / 1000
            )
            for i in range(1, 41)
        ]
        await queue.enqueue(tickets)
        for _ in range(4):  # A, B, A, B: each charged
            await queue.ready("m", 1, 1, model)
        urgent = dataclasses.replace(
            _ticket(owner, 99), tenant="A", arrival=now + 0.5, deadline=now + 3600
        )
        await queue.enqueue([urgent])  # no credit: it displaces the held one, uncharged
        assert model.batches[-1] == [99]
        if hand_back:
            await queue.back([urgent], "m", 1, None)
        sent = len(model.batches)
        for _ in range(8):
            await queue.ready("m", 1, 1, model)
        return "".join("A" if t <= 20 or t == 99 else "B" for (t,) in model.batches[sent:])

    assert asyncio.run(scenario(hand_back=True)) == asyncio.run(scenario(hand_back=False))


def test_a_ticket_granted_on_an_aged_turn_and_handed_back_is_owed_the_turn() -> None:
    """The LOW ticket aged past a CRITICAL stream gets every tenth turn; handed back
    ("not yet"), its turn was spent, and it waited ten more (found by a review)."""

    async def scenario() -> int:
        queue = QueueShell(SchedulerSettings(aging_step_s=0.1), lease_s=30.0)
        model = _Model()
        owner, _ = await queue.register("a process")
        now = time.time()
        low = dataclasses.replace(_ticket(owner, 1, Priority.LOW), arrival=now - 60)
        stream = [
            dataclasses.replace(_ticket(owner, 100 + i, Priority.CRITICAL), arrival=now)
            for i in range(200)
        ]
        await queue.enqueue([low, *stream])
        handed_back_at = None
        for turn in range(1, 100):
            await queue.ready("m", 1, 1, model)
            if model.batches[-1] == [1]:
                if handed_back_at is not None:
                    return turn - handed_back_at - 1
                handed_back_at = turn
                await queue.back([low], "m", 1, None)
        raise AssertionError("the LOW ticket never went")

    assert asyncio.run(scenario()) == 0  # the very next turn: no CRITICAL call between
