"""A model's shared actor (cluster/_model.py) with the cluster's queue (cluster/_queue.py),
on a local Ray, driven through their Ray methods as a client process drives them, against
a real simulated provider: a model holds its next call and starts it the moment a slot
frees, and a more urgent ticket (by the queue's own order: priority, then aging within
a level) takes that place. And streams through a system on Ray:
the model actor makes the streamed call, its deltas reach the owner's reader in batches
before the end, a stream cut after its first delta fails ``STREAM_CUT`` with the text
read, and a reader who leaves ends the call on the actor; a streamed call numbers its
deltas across its batches and its answer counts them, and a call its owner refuses
ends on the actor."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from callboard.cluster._connect import Connection, connect, model_name
from callboard.cluster._spool import LIMIT as SPOOL_LIMIT
from callboard.cluster._wire import Attempted, Deltas, Lease, Spent, Ticket, Unsent
from callboard.core.pricing import Price
from callboard.core.settings import SchedulerSettings
from callboard.messages import (
    CallResult,
    Cancelled,
    Completed,
    Failed,
    FailureReason,
    Priority,
    Request,
)
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime.codec import request_to_json
from support import WAIT_S, wait_until

from callboard import ModelSettings, System
from callboard.config import RayCluster

SERVICE_S = 2.0
"""Each call's time at the provider: long beside any hop, so the order is certain."""
HELD_SERVICE_S = 0.2
"""A held call's time at the provider once let go."""
SAME_TURN_S = 0.2
"""At most this between a call's end and the start of the one held for its slot: the
same loop iteration, give or take a loaded machine."""


@contextlib.contextmanager
def _shared(
    ray: Any,
    slots: int,
    service_s: float,
    behaviour: ModelBehaviour | None = None,
    lease_s: float = 30.0,
) -> Iterator[Connection]:
    """The queue and a model ``m`` of ``slots`` (calls take ``service_s``, or behave as
    ``behaviour`` says) in a namespace of the test's own."""
    with _shared_at(ray, slots, service_s, behaviour, lease_s) as (connection, _):
        yield connection


@contextlib.contextmanager
def _shared_at(
    ray: Any,
    slots: int,
    service_s: float,
    behaviour: ModelBehaviour | None = None,
    lease_s: float = 30.0,
) -> Iterator[tuple[Connection, SimulatedProvider]]:
    """``_shared``, and the provider its model calls."""
    behaviour = ModelBehaviour(latency_s=service_s) if behaviour is None else behaviour
    with SimulatedProvider(models={"m": behaviour}, seed=3) as provider:
        model = ModelSettings(name="m", base_url=provider.base_url, max_concurrency=slots)
        namespace = f"model-{os.getpid()}-{time.time_ns()}"
        cluster = RayCluster(address="local", namespace=namespace, lease_s=lease_s)
        connection = connect(cluster, {"m": model}, SchedulerSettings())
        yield connection, provider
        for actor in (connection.queue, *connection.models.values()):
            ray.kill(actor, no_restart=True)


@pytest.fixture
def one_slot(ray_local: Any) -> Iterator[Connection]:
    """A one-slot model ``m`` whose calls take ``SERVICE_S``."""
    with _shared(ray_local, 1, SERVICE_S) as connection:
        yield connection


@pytest.fixture
def one_held_slot(ray_local: Any) -> Iterator[tuple[Connection, SimulatedProvider]]:
    """A one-slot model ``m`` whose calls take ``HELD_SERVICE_S`` once the provider lets
    them go (``provider.held``): a call stays on the wire while the test looks, however
    loaded the machine (a 2 s call was a race, and 8 s a test)."""
    with _shared_at(ray_local, 1, HELD_SERVICE_S) as shared:
        yield shared


@pytest.fixture
def four_fast_slots(ray_local: Any) -> Iterator[Connection]:
    """A four-slot model ``m`` whose calls take 10 ms."""
    with _shared(ray_local, 4, 0.01) as connection:
        yield connection


def _ticket(owner: int, task_id: int, priority: Priority, waited_s: float = 0.0) -> Ticket:
    """A ticket for ``m`` that arrived ``waited_s`` ago."""
    request = Request.of(f"task {task_id}", priority=priority, max_tokens=8)
    return Ticket(
        owner=owner,
        task_id=task_id,
        attempt=0,
        priority=int(priority),
        arrival=time.time() - waited_s,
        deadline=None,
        lanes=("m",),
        tenant=None,
        cost=20,
        trace_id=f"t{task_id}",
        request=request_to_json(request),
        prompt_tokens=4,
    )


def _state(ray: Any, actor: Any) -> dict[str, Any]:
    """A shared actor's ``state()``, asked through Ray."""
    state: dict[str, Any] = ray.get(actor.state.remote(), timeout=WAIT_S)
    return state


def test_a_model_actor_whose_cas_cannot_be_loaded_fails_its_start_naming_them(
    ray_local: Any, ray_namespace: str
) -> None:
    """Its HTTP client was made at its first call: CAs that could not be loaded (a
    missing ``SSL_CERT_FILE`` in the actor's environment) failed that call's batch with
    its slots held for good, every later call alike, and no process heard why; its
    tasks waited for ever (found by a hunt). Its start fails now, naming the file."""
    from callboard.cluster._model import ModelShell

    settings = ModelSettings(name="m", base_url="https://127.0.0.1:9/v1")
    missing = {"SSL_CERT_FILE": "/nonexistent/callboard-ca.pem"}
    shell = (
        ray_local.remote(ModelShell)
        .options(namespace=ray_namespace, name="m", num_cpus=0, runtime_env={"env_vars": missing})
        .remote(settings, None, 30.0)
    )
    with pytest.raises(ray_local.exceptions.RayActorError) as died:
        ray_local.get(shell.__ray_ready__.remote(), timeout=WAIT_S)
    assert "ConfigError" in str(died.value)
    assert "/nonexistent/callboard-ca.pem" in str(died.value)


def test_a_held_low_call_gives_its_place_to_a_critical_one(
    one_held_slot: tuple[Connection, SimulatedProvider], ray_local: Any
) -> None:
    connection, provider = one_held_slot
    queue, model = connection.queue, connection.models["m"]
    owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
    ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants

    with provider.held("m"):
        # LOW 1 takes the slot; LOW 2 is held, to start the moment the slot frees
        queue.enqueue.remote([_ticket(owner, 1, Priority.LOW), _ticket(owner, 2, Priority.LOW)])
        assert wait_until(lambda: _state(ray_local, model)["held"] == int(Priority.LOW))
        assert _state(ray_local, model)["in_flight"] == 1

        # CRITICAL finds no credit: it takes LOW 2's place at the model, LOW 2 waits again
        queue.enqueue.remote([_ticket(owner, 3, Priority.CRITICAL)])

        assert wait_until(lambda: _state(ray_local, model)["held"] == int(Priority.CRITICAL))
        assert wait_until(lambda: _state(ray_local, queue)["waiting"] == 1)  # LOW 2, back
        assert _state(ray_local, queue)["displaced"] == 1
        assert _state(ray_local, model)["in_flight"] == 1  # LOW 1 still on the wire

    answers: dict[int, Attempted] = {}
    while len(answers) < 3:
        news = ray_local.get(model.collect.remote(owner, 1.0), timeout=WAIT_S)
        answers.update({a.task_id: a for a in news.answers if isinstance(a, Attempted)})
    first, critical, low = (answers[i].result for i in (1, 3, 2))
    assert all(r.status_code == 200 for r in (first, critical, low))
    # each call started in the loop iteration the one before ended: no hop in between
    assert first.ended_at <= critical.started_at < first.ended_at + SAME_TURN_S
    assert critical.ended_at <= low.started_at < critical.ended_at + SAME_TURN_S


def test_a_held_ticket_its_owner_gave_up_is_never_called(ray_local: Any) -> None:
    """The owner cancelled task 2 while the model held it as its next call: it was
    called anyway once the slot freed (a paid call for a task already ``Cancelled``),
    and the next task waited a whole call behind it."""
    with _shared(ray_local, 1, 0.5) as connection:
        _held_ticket_given_up(connection, ray_local)


def _held_ticket_given_up(one_slot: Connection, ray_local: Any) -> None:
    queue, model = one_slot.queue, one_slot.models["m"]
    owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
    ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants
    queue.enqueue.remote([_ticket(owner, 1, Priority.LOW), _ticket(owner, 2, Priority.LOW)])
    assert wait_until(lambda: _state(ray_local, model)["held"] == int(Priority.LOW))

    ray_local.get(model.abandon.remote(owner, [2]), timeout=WAIT_S)
    assert _state(ray_local, model)["held"] is None
    queue.enqueue.remote([_ticket(owner, 3, Priority.LOW)])  # takes the place 2 left

    answers = _answers(ray_local, model, owner, 2)
    assert sorted(answers) == [1, 3]
    assert _state(ray_local, model)["sent"] == 2, "task 2 was never called"
    assert answers[1].result.ended_at <= answers[3].result.started_at


AGED_S = 3 * SchedulerSettings().aging_step_s  # type: ignore[operator]  # 10 s by default
"""Three aging steps: a NORMAL ticket that waited this long is aged past a fresh HIGH."""


def _answers(ray: Any, model: Any, owner: int, n: int) -> dict[int, Attempted]:
    """The first ``n`` answers ``owner`` collects from ``model``, by task id."""
    answers: dict[int, Attempted] = {}
    while len(answers) < n:
        news = ray.get(model.collect.remote(owner, 1.0), timeout=WAIT_S)
        answers.update({a.task_id: a for a in news.answers if isinstance(a, Attempted)})
    return answers


def test_a_more_urgent_ticket_takes_the_place_of_a_held_one_that_aged(
    one_held_slot: tuple[Connection, SimulatedProvider], ray_local: Any
) -> None:
    connection, provider = one_held_slot
    queue, model = connection.queue, connection.models["m"]
    owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
    ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants
    with provider.held("m"):
        queue.enqueue.remote([_ticket(owner, 1, Priority.LOW)])  # takes the slot
        assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 1)
        queue.enqueue.remote([_ticket(owner, 2, Priority.NORMAL, waited_s=AGED_S)])
        assert wait_until(lambda: _state(ray_local, model)["held"] == int(Priority.NORMAL))

        # HIGH 3 finds no credit: however long NORMAL 2 waited, HIGH comes first in the
        # queue's order (aged tasks take a share of the queue's turns, never a place ahead
        # of a more urgent level), so it takes the held place and NORMAL 2 goes back
        queue.enqueue.remote([_ticket(owner, 3, Priority.HIGH)])
        assert wait_until(lambda: _state(ray_local, queue)["displaced"] == 1)
        assert wait_until(lambda: _state(ray_local, model)["held"] == int(Priority.HIGH))

    answers = _answers(ray_local, model, owner, 3)
    first, aged, urgent = (answers[i].result for i in (1, 2, 3))
    assert first.ended_at <= urgent.started_at < first.ended_at + SAME_TURN_S
    assert urgent.ended_at <= aged.started_at


def test_a_ticket_that_aged_leaves_a_held_more_urgent_one_its_place(
    one_held_slot: tuple[Connection, SimulatedProvider], ray_local: Any
) -> None:
    connection, provider = one_held_slot
    queue, model = connection.queue, connection.models["m"]
    owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
    ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)
    with provider.held("m"):
        queue.enqueue.remote([_ticket(owner, 1, Priority.LOW)])
        assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 1)
        queue.enqueue.remote([_ticket(owner, 2, Priority.HIGH)])  # held
        assert wait_until(lambda: _state(ray_local, model)["held"] == int(Priority.HIGH))

        # NORMAL 3 waited three aging steps: HIGH 2 keeps its place and NORMAL 3 waits in
        # the queue. The queue may try (it heard last of LOW 1 as what the model might
        # hold): the model, comparing by the same order, sends NORMAL 3 back.
        queue.enqueue.remote([_ticket(owner, 3, Priority.NORMAL, waited_s=AGED_S)])

        def normal_waits_high_held() -> bool:
            waiting = _state(ray_local, queue)["waiting"]
            return waiting == 1 and _state(ray_local, model)["held"] == int(Priority.HIGH)

        assert wait_until(normal_waits_high_held)
    answers = _answers(ray_local, model, owner, 3)
    assert answers[2].result.ended_at <= answers[3].result.started_at


def test_a_lightly_loaded_model_grants_its_credits_in_batches(
    four_fast_slots: Connection, ray_local: Any
) -> None:
    # one call at a time on four slots: while the queue holds half the model's credits
    # or more, a freed slot is not granted at once (that grant would land on the queue
    # with the next call's ticket and pay for nothing); the credits come back in
    # batches, before the queue runs short
    queue, model = four_fast_slots.queue, four_fast_slots.models["m"]
    owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
    ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants
    assert wait_until(lambda: _state(ray_local, queue)["credits"] == {"m": 5})  # 4 + held
    calls = 12
    for i in range(calls):
        queue.enqueue.remote([_ticket(owner, i, Priority.NORMAL)])
        assert _answers(ray_local, model, owner, 1)[i].result.status_code == 200
    state = _state(ray_local, model)
    assert state["in_flight"] == 0
    assert state["grants"] <= 1 + calls // 2, state  # not one a call
    assert state["granted"] >= 2  # half the slots and the held place, rounded down
    assert wait_until(lambda: _state(ray_local, queue)["credits"] == {"m": state["granted"]})


def test_a_restarted_queue_gets_an_idle_model_s_credits_again(
    one_slot: Connection, ray_local: Any
) -> None:
    # the queue dies holding every credit of an idle model: the model hears of the new
    # queue from an owner's poll and grants afresh (it would otherwise wait for a slot
    # to free, and none is busy)
    queue, model = one_slot.queue, one_slot.models["m"]
    owner, first = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
    ray_local.get(model.collect.remote(owner, 0.0, first), timeout=WAIT_S)

    assert wait_until(
        lambda: _state(ray_local, queue)["credits"] == {"m": 2}
    )  # the slot and the held place
    ray_local.kill(queue, no_restart=False)
    registered: list[tuple[int, int]] = []

    def register() -> bool:  # the kill takes effect, then Ray restarts the queue
        with contextlib.suppress(ray_local.exceptions.RayError):
            registered.append(ray_local.get(queue.register.remote("test"), timeout=WAIT_S))
        return bool(registered) and registered[-1][1] != first

    assert wait_until(register)
    owner, second = registered[-1]
    assert _state(ray_local, queue)["credits"] == {}  # the new queue has none
    ray_local.get(model.collect.remote(owner, 0.0, second), timeout=WAIT_S)
    queue.enqueue.remote([_ticket(owner, 1, Priority.NORMAL)])
    news = ray_local.get(model.collect.remote(owner, 2 * SERVICE_S + 5, second), timeout=WAIT_S)
    while not news.answers:
        news = ray_local.get(model.collect.remote(owner, 1.0, second), timeout=WAIT_S)
    (answer,) = news.answers
    assert isinstance(answer, Attempted)
    assert answer.result.status_code == 200


# -- streams through a system on Ray ---------------------------------------------------------

PRICE = Price(input_per_mtok=Decimal(1000), output_per_mtok=Decimal(2000))


def test_streams_on_ray_reach_their_readers_before_their_end(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    read_stream: Callable[..., Any],
) -> None:
    # 12 tokens, 40 ms apart: the end comes ~0.5 s after the first delta
    shared_provider.configure("m", ModelBehaviour(ttft_s=0.02, token_gap_s=0.04))
    cb = cluster_systems(price=PRICE)
    for i in range(3):  # one after the other: each read as it comes
        stream = cb.stream(f"tell me {i}", max_tokens=12)
        reader = read_stream(stream)
        reader.next(f"stream {i}'s first delta")
        with pytest.raises(TimeoutError):
            stream.result(timeout=0)  # the first delta came before the end
        reader.rest(f"stream {i}'s other deltas")
        result = stream.result(WAIT_S)
        assert isinstance(result, Completed), result
        assert len(reader.read) > 1
        assert reader.text == result.content != ""
        assert result.usage.completion_tokens > 0
        assert not result.usage.estimated  # the provider's count, from the stream's end
        assert result.cost_nusd > 0
        assert result.attempts == 1
    assert shared_provider.stats()["total"]["requests"] == 3


def test_a_stream_cut_on_ray_fails_stream_cut_with_the_text_read(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    read_stream: Callable[..., Any],
) -> None:
    behaviour = ModelBehaviour(ttft_s=0.02, cut_rate=1.0, cut_after=4, cut_mode="close")
    shared_provider.configure("m", behaviour)
    cb = cluster_systems()
    stream = cb.stream("tell me", max_tokens=20)
    reader = read_stream(stream)
    result = reader.cut("the cut stream's deltas and end")
    assert reader.read
    assert reader.text != ""
    assert result.attempts == 1, "a stream the reader has part of is not sent again"
    assert shared_provider.stats()["total"]["requests"] == 1


def test_a_reader_who_leaves_ends_the_call_on_the_model_actor(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
    read_stream: Callable[..., Any],
) -> None:
    # a long stream (200 tokens, 50 ms apart: 10 s) left after its first delta
    shared_provider.configure(
        "m", ModelBehaviour(ttft_s=0.02, token_gap_s=0.05, completion_tokens=200)
    )
    cb = cluster_systems()
    stream = cb.stream("tell me", max_tokens=200)
    read_stream(stream).next("the long stream's first delta")
    stream.close()
    assert isinstance(stream.result(WAIT_S), Cancelled)
    model = ray_local.get_actor(model_name("m"), namespace=ray_namespace)
    assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 0, timeout=5.0)  # not 10 s


def test_a_slow_reader_on_ray_stops_the_call_reading_and_loses_nothing(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
    read_stream: Callable[..., Any],
) -> None:
    # 3000 deltas as fast as the connection takes them; the reader takes one, then stops
    shared_provider.configure("m", ModelBehaviour(ttft_s=0.02, completion_tokens=3000))
    cb = cluster_systems()
    stream = cb.stream("tell me", max_tokens=3000)
    reader = read_stream(stream)
    reader.next("the long stream's first delta")
    model = ray_local.get_actor(model_name("m"), namespace=ray_namespace)

    def on_the_actor() -> dict[str, Any]:
        return _state(ray_local, model)

    # the owner holds its channel's and its feed's worth, then pauses the call, whose
    # spool fills: the call waits there, its socket unread
    def held_back() -> bool:
        state = on_the_actor()
        return (state["paused"], state["spooled"]) == (1, SPOOL_LIMIT)

    assert wait_until(held_back), on_the_actor()
    assert on_the_actor()["in_flight"] == 1
    with pytest.raises(TimeoutError):
        stream.result(timeout=0)
    reader.rest("the held-back stream's other deltas")
    result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert reader.text == result.content
    assert len(reader.read) > 2 * SPOOL_LIMIT
    assert on_the_actor()["streams"] == 0


def test_a_stream_whose_model_actor_restarts_is_cut_not_sent_again(
    cluster_systems: Callable[..., System],
    shared_provider: SimulatedProvider,
    ray_local: Any,
    ray_namespace: str,
    read_stream: Callable[..., Any],
) -> None:
    # a 10 s stream; its model actor is killed after the first delta and Ray restarts it
    shared_provider.configure(
        "m", ModelBehaviour(ttft_s=0.02, token_gap_s=0.05, completion_tokens=200)
    )
    cb = cluster_systems()
    stream = cb.stream("tell me", max_tokens=200)
    reader = read_stream(stream)
    reader.next("the long stream's first delta")
    ray_local.kill(ray_local.get_actor(model_name("m"), namespace=ray_namespace), no_restart=False)
    result = reader.cut("the stream cut by its model's restart")
    assert "restarted" in result.detail
    assert result.usage.estimated  # its count was lost with the actor: the most it could use
    assert shared_provider.stats()["total"]["requests"] == 1, "never a second call"


def test_a_streamed_call_numbers_its_deltas_and_a_refused_one_ends_on_the_actor(
    ray_local: Any,
) -> None:
    # two streams, 20 ms a token: one of 20 tokens read to its end, one of 400 (8 s)
    # refused by its owner once its first deltas came
    behaviour = ModelBehaviour(ttft_s=0.02, token_gap_s=0.02, completion_tokens=400)
    with _shared(ray_local, 2, 0.0, behaviour) as connection:
        queue, model = connection.queue, connection.models["m"]
        owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
        ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants
        tickets = [
            dataclasses.replace(
                _ticket(owner, task_id, Priority.NORMAL),
                request=request_to_json(Request.of(f"tell me {task_id}", max_tokens=tokens)),
                cost=tokens + 4,
                streamed=True,
            )
            for task_id, tokens in ((1, 20), (2, 400))
        ]
        queue.enqueue.remote(tickets)
        batches: dict[int, list[Deltas]] = {1: [], 2: []}
        answers: dict[int, Attempted] = {}
        wrong: int | None = None  # the long call's deltas when refused by a wrong incarnation
        while len(answers) < 2:
            news = ray_local.get(model.collect.remote(owner, 1.0), timeout=WAIT_S)
            for batch in news.streams:
                batches[batch.task_id].append(batch)
            answers.update({a.task_id: a for a in news.answers if isinstance(a, Attempted)})
            long = batches[2]
            if long and wrong is None:  # another incarnation's call of that number: not it
                model.refuse.remote(owner, news.incarnation + 1, [long[0].call])
                wrong = sum(len(b.deltas) for b in long)
            elif wrong is not None and sum(len(b.deltas) for b in long) > wrong + 2:
                model.refuse.remote(owner, news.incarnation, [long[0].call])  # it goes on
        for task_id, answer in answers.items():
            got = batches[task_id]
            assert got
            assert {b.call for b in got} == {answer.call}
            seqs = [b.seq for b in got]
            ends = [b.seq + len(b.deltas) for b in got]
            assert seqs == [0, *ends[:-1]], seqs  # from the first, no gap, no repeat
            assert answer.deltas == ends[-1]  # the answer counts every delta sent
        short, refused = answers[1].result, answers[2].result
        assert short.error is None
        assert "".join(d.text for b in batches[1] for d in b.deltas) == short.content
        assert refused.error == "abandoned"
        assert wrong is not None
        assert wrong + 2 < answers[2].deltas < 200  # on past the wrong refusal; not to 400
        assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 0)


def test_a_ticket_the_model_cannot_read_is_refused_and_the_rest_of_its_batch_called(
    four_fast_slots: Connection, ray_local: Any
) -> None:
    # a request from a newer process (a field this actor does not know) between two it
    # reads: the batch stopped at it, the first call never started and held its slot for
    # ever, and no answer came for any of the three (found by a hunt)
    queue, model = four_fast_slots.queue, four_fast_slots.models["m"]
    owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
    newer = json.loads(request_to_json(Request.of("from a newer version", max_tokens=8)))
    newer["a_field_from_a_newer_version"] = 1
    bad = dataclasses.replace(_ticket(owner, 2, Priority.NORMAL), request=json.dumps(newer))
    tickets = [_ticket(owner, 1, Priority.NORMAL), bad, _ticket(owner, 3, Priority.NORMAL)]
    incarnation = _state(ray_local, model)["incarnation"]
    ray_local.get(model.call.remote(incarnation, tickets, [0, 0, 0]), timeout=WAIT_S)
    answers: dict[int, Attempted | Unsent] = {}
    while len(answers) < 3:
        news = ray_local.get(model.collect.remote(owner, 1.0), timeout=WAIT_S)
        answers.update({a.task_id: a for a in news.answers})
    called, refused = (answers[1], answers[3]), answers[2]
    assert all(isinstance(a, Attempted) and a.result.status_code == 200 for a in called)
    assert isinstance(refused, Unsent)
    assert refused.why == "refused"
    assert "cannot read it" in refused.detail
    assert "a_field_from_a_newer_version" in refused.detail
    state = _state(ray_local, model)
    assert (state["in_flight"], state["sent"]) == (0, 2)


def test_a_dead_owners_stream_frees_its_slot_when_nobody_else_polls_the_model(
    ray_local: Any,
) -> None:
    """The leases were swept only in an owner's poll: once the only owner died
    mid-stream, its call held the model's slot and its provider connection for good
    (found by a hunt)."""
    behaviour = ModelBehaviour(ttft_s=0.01, token_gap_s=0.01, completion_tokens=4000)
    with _shared(ray_local, 1, 0.0, behaviour, lease_s=1.0) as connection:
        queue, model = connection.queue, connection.models["m"]
        owner, _ = ray_local.get(queue.register.remote("dies"), timeout=WAIT_S)

        def granted() -> bool:
            # the owner polls the model (which grants the queue) until the queue holds the
            # credit: a ticket that waited for it in the queue was dropped there when the
            # grant took longer than the lease on a loaded machine (the owner polls no
            # queue here; a fresh-clone CI run's failure), and ``enqueue`` renews it
            ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)
            return bool(_state(ray_local, queue)["credits"].get("m", 0) > 0)

        assert wait_until(granted)
        ticket = dataclasses.replace(
            _ticket(owner, 1, Priority.NORMAL),
            request=request_to_json(Request.of("a long story", max_tokens=4000)),
            cost=4004,
            streamed=True,
        )
        queue.enqueue.remote([ticket])

        def streaming() -> bool:
            # the owner polls, its lease fresh, until its stream is seen: its lease ran
            # from its first poll, and on a loaded machine the ticket's way to the model
            # took longer than the lease, which ended the call before it was seen (a
            # fresh-clone CI run's failure)
            ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)
            return bool(_state(ray_local, model)["streams"] == 1)

        assert wait_until(streaming)
        # the owner is gone: nobody polls the model from now on
        assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 0)
        assert _state(ray_local, model)["streams"] == 0


def test_a_held_ticket_of_an_owner_gone_past_its_lease_is_never_called(ray_local: Any) -> None:
    """The model swept a silent owner's answers and streams, not the ticket it held as
    its next call: that one was called when the slot freed, past the owner's lease,
    for a process killed before (found by a hunt)."""
    with _shared(ray_local, 1, 3.0, lease_s=1.0) as connection:
        queue, model = connection.queue, connection.models["m"]
        owner, _ = ray_local.get(queue.register.remote("dies"), timeout=WAIT_S)
        ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants
        queue.enqueue.remote([_ticket(owner, 1, Priority.LOW), _ticket(owner, 2, Priority.LOW)])

        # the owner polls until the ticket is held: on a loaded machine a second passed
        # between its one poll and the tickets' arrival, and it lapsed there first
        def held() -> bool:
            ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)
            return _state(ray_local, model)["held"] == int(Priority.LOW)

        assert wait_until(held)
        # the owner is gone: it polls no more, and the call in flight outlasts its lease
        assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 0)
        state = _state(ray_local, model)
    assert state["held"] is None
    assert state["sent"] == 1, "the held ticket was called past its owner's lease"


def test_a_call_whose_body_cannot_be_made_fails_its_task_alone_as_a_local_one_does(
    cluster_systems: Callable[..., System], ray_local: Any, ray_namespace: str
) -> None:
    """Told to its owner as a refusal, it ended REQUEST_ERROR and went on to each
    fallback, the caller told it was the request's fault (a review)."""

    def poisoned_send_of(_shell: Any) -> None:  # by value, into the shared actor's process
        from callboard.cluster import _model

        real = _model.send_of

        def send_of(task: Any, *args: Any) -> Any:
            if task.request.messages[0].content == "poison":
                raise ValueError("a body no check foresaw")
            return real(task, *args)

        _model.send_of = send_of

    system = cluster_systems(max_concurrency=2)
    assert isinstance(system.submit("warm").result(timeout=WAIT_S), Completed)
    model = ray_local.get_actor(model_name("m"), namespace=ray_namespace)
    ray_local.get(model.__ray_call__.remote(poisoned_send_of), timeout=WAIT_S)
    poisoned = system.submit("poison").result(timeout=WAIT_S)
    assert isinstance(poisoned, Failed), poisoned
    assert poisoned.reason is FailureReason.INTERNAL
    assert "could not make the call's body: ValueError" in poisoned.detail
    assert isinstance(system.submit("after").result(timeout=WAIT_S), Completed)
    assert _state(ray_local, model)["in_flight"] == 0


# -- leases: calls an owner makes itself (cluster/_lease.py) --------------------------------


ON_THE_WIRE_S = 60.0
"""A call that stays on the wire for the whole test (its end is never waited for): a
loaded machine's pause outlasted ``SERVICE_S`` between a test's steps."""


def _granted(ray: Any, queue: Any, model: Any, expected: int) -> int:
    """A new owner, heard by ``model``, whose ``expected`` credits (its slots and the held place)
    the queue then holds."""
    owner, _ = ray.get(queue.register.remote("test"), timeout=WAIT_S)
    ray.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants
    assert wait_until(lambda: _state(ray, queue)["credits"] == {"m": expected})
    return int(owner)


def _spent(permit: int, status: int = 200) -> Spent:
    """An owner's word that the call on ``permit`` ended with HTTP ``status``."""
    now = time.monotonic()
    result = CallResult(
        task_id=permit,
        attempt=1,
        started_at=now - 0.01,
        ended_at=now,
        status_code=status,
        detail="" if status == 200 else "server error",
    )
    return Spent(permit=permit, result=result)


def test_a_model_lends_only_spare_capacity_and_nothing_while_a_ticket_waits(
    ray_local: Any,
) -> None:
    with _shared(ray_local, 4, ON_THE_WIRE_S) as connection:
        queue, model = connection.queue, connection.models["m"]
        owner, _ = ray_local.get(queue.register.remote("test"), timeout=WAIT_S)
        assert ray_local.get(model.lease.remote(owner, 2, 20), timeout=WAIT_S) is None  # unheard
        ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)  # the model grants
        assert wait_until(lambda: _state(ray_local, queue)["credits"] == {"m": 5})

        lease = ray_local.get(model.lease.remote(owner, 10, 20), timeout=WAIT_S)
        assert isinstance(lease, Lease)
        assert len(lease.permits) == 3  # one of the four slots stays the queue's
        assert ray_local.get(model.lease.remote(owner, 1, 20), timeout=WAIT_S) is None

        # two tickets on the queue's credits: one takes the free slot, one is held
        queue.enqueue.remote([_ticket(owner, 1, Priority.LOW), _ticket(owner, 2, Priority.LOW)])
        assert wait_until(lambda: _state(ray_local, model)["held"] == int(Priority.LOW))
        assert _state(ray_local, model)["in_flight"] == 1  # never over the cap

        # a permit given back frees its slot: the held ticket takes it, none is lent
        ray_local.get(model.report.remote(owner, lease.incarnation, [], [lease.permits[0]]))
        assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 2)
        assert ray_local.get(model.lease.remote(owner, 1, 20), timeout=WAIT_S) is None

        # a permit's call reported made is learnt from; one of another incarnation is void
        ray_local.get(
            model.report.remote(owner, lease.incarnation + 1, [_spent(lease.permits[1])], [])
        )
        assert _state(ray_local, model)["lent"] == 2
        ray_local.get(model.report.remote(owner, lease.incarnation, [_spent(lease.permits[1])], []))
        state = _state(ray_local, model)
        assert (state["lent"], state["spent"]) == (1, 1)


def test_a_model_lends_nothing_while_its_queue_says_tickets_wait_for_it(
    four_fast_slots: Connection, ray_local: Any
) -> None:
    # a slot that frees while tickets wait in the queue is theirs: a process asking in
    # the moment between (the grant on its way) took it, ahead of a CRITICAL ticket
    queue, model = four_fast_slots.queue, four_fast_slots.models["m"]
    owner = _granted(ray_local, queue, model, 5)
    incarnation = _state(ray_local, model)["incarnation"]
    ray_local.get(model.call.remote(incarnation, [], [], False, 2), timeout=WAIT_S)
    assert ray_local.get(model.lease.remote(owner, 1, 20), timeout=WAIT_S) is None
    ray_local.get(model.call.remote(incarnation, [], [], False, 0), timeout=WAIT_S)
    assert isinstance(ray_local.get(model.lease.remote(owner, 1, 20), timeout=WAIT_S), Lease)


def test_permits_not_used_are_called_back_once_a_ticket_waits_for_a_slot(
    ray_local: Any,
) -> None:
    # unused, they held their slots (and limiter reservations) a CRITICAL ticket waited
    # behind for up to PERMIT_S (found by a review): the owner's poll says give them back
    with _shared(ray_local, 4, ON_THE_WIRE_S) as connection:
        queue, model = connection.queue, connection.models["m"]
        owner = _granted(ray_local, queue, model, 5)
        lease = ray_local.get(model.lease.remote(owner, 3, 20), timeout=WAIT_S)
        assert isinstance(lease, Lease)
        queue.enqueue.remote(
            [_ticket(owner, 1, Priority.LOW), _ticket(owner, 2, Priority.CRITICAL)]
        )
        assert wait_until(lambda: _state(ray_local, model)["held"] is not None)
        news = ray_local.get(model.collect.remote(owner, 5.0), timeout=WAIT_S)
        assert news.recall
        ray_local.get(model.report.remote(owner, lease.incarnation, [], list(lease.permits)))
        assert wait_until(lambda: _state(ray_local, model)["in_flight"] == 2)  # held: started
        assert _state(ray_local, model)["held"] is None


def test_calls_a_restarted_model_adopts_take_its_slots_until_reported(
    four_fast_slots: Connection, ray_local: Any
) -> None:
    # the calls an owner has on the wire on a dead incarnation's permits: the new one
    # admitted its whole cap beside them (found by a review)
    queue, model = four_fast_slots.queue, four_fast_slots.models["m"]
    owner = _granted(ray_local, queue, model, 5)
    incarnation, permits = ray_local.get(model.adopt.remote(owner, 2), timeout=WAIT_S)
    assert incarnation == _state(ray_local, model)["incarnation"]
    assert len(permits) == 2
    lease = ray_local.get(model.lease.remote(owner, 4, 20), timeout=WAIT_S)
    assert isinstance(lease, Lease)
    assert len(lease.permits) == 1  # four slots: two adopted, one left for the queue
    spent = [_spent(p, status=500) for p in permits]  # learnt by the incarnation before
    ray_local.get(model.report.remote(owner, incarnation, spent, []), timeout=WAIT_S)
    state = _state(ray_local, model)
    assert (state["lent"], state["adopted"], state["breaker"]) == (1, 0, "closed")


def test_failures_reported_on_lent_calls_open_the_shared_breaker_and_stop_the_lending(
    ray_local: Any,
) -> None:
    with _shared(ray_local, 8, 0.01) as connection:
        queue, model = connection.queue, connection.models["m"]
        owner = _granted(ray_local, queue, model, 9)
        failed = 0
        while _state(ray_local, model)["breaker"] == "closed":
            lease = ray_local.get(model.lease.remote(owner, 4, 20), timeout=WAIT_S)
            assert isinstance(lease, Lease), f"no lease with the breaker closed after {failed}"
            spent = [_spent(p, status=500) for p in lease.permits]
            ray_local.get(model.report.remote(owner, lease.incarnation, spent, []))
            failed += len(spent)
            assert failed < 200
        assert ray_local.get(model.lease.remote(owner, 4, 20), timeout=WAIT_S) is None
        news = ray_local.get(model.collect.remote(owner, 0.0), timeout=WAIT_S)
        assert news.health is not None
        assert news.health.breaker.value == "open"  # the owners hear of it in their polls


def test_permits_of_an_owner_gone_past_its_lease_are_taken_back(ray_local: Any) -> None:
    with _shared(ray_local, 4, 0.01, lease_s=1.0) as connection:
        queue, model = connection.queue, connection.models["m"]
        dead, _ = ray_local.get(queue.register.remote("dies"), timeout=WAIT_S)
        alive, _ = ray_local.get(queue.register.remote("lives"), timeout=WAIT_S)
        ray_local.get(model.collect.remote(dead, 0.0), timeout=WAIT_S)
        assert wait_until(lambda: _state(ray_local, queue)["credits"] == {"m": 5})
        lease = ray_local.get(model.lease.remote(dead, 3, 20), timeout=WAIT_S)
        assert isinstance(lease, Lease)
        assert _state(ray_local, model)["lent"] == 3

        def swept() -> bool:  # the living owner's polls sweep the dead one's lease
            ray_local.get(model.collect.remote(alive, 0.0), timeout=WAIT_S)
            return _state(ray_local, model)["lent"] == 0

        assert wait_until(swept)
        # its slots are the cluster's again: the living owner is lent them
        again = ray_local.get(model.lease.remote(alive, 3, 20), timeout=WAIT_S)
        assert isinstance(again, Lease)
        assert len(again.permits) == 3
