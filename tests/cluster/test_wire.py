"""What crosses to the cluster (cluster/_wire.py): a ticket keeps a task's place in the
global order on the wall clock, and the model actor's task is the same request with
its deadline on its own clock; a stream's deltas are taken only in order from its
first, a batch lost on the way showing as a gap; a model's health reaches its owners
with its times on their clock."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys

import pytest
from callboard.cluster._wire import (
    KEY_BITS,
    Deltas,
    ModelNews,
    clock_of,
    on_my_clock,
    queue_settings,
    settings_digest,
    task_of,
    ticket_of,
    unheard,
)
from callboard.core.settings import ModelSettings, SchedulerSettings
from callboard.messages import BreakerState, Health, Job, Priority, Request, StreamDelta, Task
from callboard.messages._future import TaskFuture
from callboard.runtime.stream import StreamChannel


def test_a_ticket_carries_the_task_on_the_wall_clock_and_pickles() -> None:
    request = Request.of("hello", priority=Priority.HIGH, max_tokens=20, budget_tag="team-a")
    task = Task(
        task_id=7,
        trace_id="t7",
        request=request,
        submitted_at=10.0,
        deadline_at=40.0,
        prompt_tokens=5,
        future=TaskFuture(7, "t7"),
    )
    job = Job(task=task, candidates=("m", "n"), attempt=2)
    ticket = ticket_of(job, 3, now=12.0, wall=1000.0)
    assert pickle.loads(pickle.dumps(ticket)) == ticket  # noqa: S301 - our own bytes; no future, no mapping proxy
    assert (ticket.arrival, ticket.deadline) == (998.0, 1028.0)
    assert (ticket.priority, ticket.tenant, ticket.cost) == (
        int(Priority.HIGH),
        "team-a",
        5,
    )  # the prompt: the answer is settled
    assert (ticket.attempt, ticket.lanes) == (2, ("m", "n"))
    assert ticket.key == 3 << KEY_BITS | 7

    remote = task_of(ticket, 99, now=500.0, wall=1001.0)  # another clock, a second later
    assert remote.task_id == 99
    assert remote.request == request
    assert remote.deadline_at == 527.0  # 27 s left, as on the owner's clock
    assert remote.prompt_tokens == 5
    assert not ticket.streamed
    assert remote.stream is None


def test_a_streamed_task_s_ticket_says_so_and_its_deltas_pickle() -> None:
    request = Request.of("hello", max_tokens=20)
    channel = StreamChannel()
    task = Task(task_id=7, trace_id="t7", request=request, submitted_at=10.0, stream=channel)
    ticket = ticket_of(Job(task=task, candidates=("m",)), 3, now=12.0, wall=1000.0)
    assert ticket.streamed
    assert pickle.loads(pickle.dumps(ticket)) == ticket  # noqa: S301 - our own bytes; the channel stays here
    spool = StreamChannel()
    assert task_of(ticket, 99, now=500.0, wall=1001.0, stream=spool).stream is spool
    deltas = Deltas(task_id=7, attempt=0, call=99, seq=0, deltas=(StreamDelta(text="he"),))
    news = ModelNews(model="m", incarnation=1, answers=(), health=None, streams=(deltas,))
    assert pickle.loads(pickle.dumps(news)) == news  # noqa: S301 - our own bytes


def _batch(seq: int, texts: str) -> Deltas:
    return Deltas(
        task_id=7, attempt=0, call=1, seq=seq, deltas=tuple(StreamDelta(text=t) for t in texts)
    )


def _texts(deltas: tuple[StreamDelta, ...] | None) -> str | None:
    return None if deltas is None else "".join(d.text for d in deltas)


def test_a_stream_s_deltas_are_taken_in_order_from_its_first_and_a_gap_is_seen() -> None:
    assert _texts(unheard(_batch(0, "abc"), 0)) == "abc"  # the first batch: its beginning
    assert _texts(unheard(_batch(3, "de"), 3)) == "de"  # the next follows the last heard
    assert unheard(_batch(3, "de"), 0) is None  # the first batch was lost: a gap
    assert unheard(_batch(5, "f"), 3) is None  # one lost mid-way: a gap
    assert _texts(unheard(_batch(2, "cde"), 3)) == "de"  # each delta once
    assert unheard(_batch(0, "abc"), 3) == ()  # nothing new
    with pytest.raises(ValueError, match="numbered from 0"):
        _batch(-1, "a")
    with pytest.raises(ValueError, match="count of deltas"):
        unheard(_batch(0, "a"), -1)


def test_queue_settings_alike_read_alike_however_they_were_written() -> None:
    # a repr of each warned of differences that were none: 30 against 30.0, weights in
    # another order, and a setting the shared queue never uses (found by a review)
    first = SchedulerSettings(aging_step_s=10, aging_share=0.25, tenant_weights={"a": 1, "b": 2})
    second = SchedulerSettings(
        aging_step_s=10.0, aging_share=0.25, tenant_weights={"b": 2.0, "a": 1.0}
    )
    third = dataclasses.replace(second, escalate_margin_s=5.0)
    assert queue_settings(first, 30) == queue_settings(second, 30.0) == queue_settings(third, 30)
    other = queue_settings(SchedulerSettings(capacity=2), 30)
    assert [k for k, v in other.items() if queue_settings(first, 30)[k] != v] == [
        "capacity",
        "aging_share",
        "tenant_weights",
    ]


def test_a_models_health_reaches_its_owner_with_its_times_on_the_owners_clock() -> None:
    """Relayed as read, an open breaker's ``reopen_at`` and a 429's ``paused_until`` were
    the model actor's monotonic times: on another machine the owner's stats said
    "reopens in" (and a gateway's ``Retry-After``) whatever the two clocks' gap was."""
    health = Health(model="m", breaker=BreakerState.OPEN, reopen_at=5_030.0, paused_until=5_002.0)
    here = on_my_clock(health, at=5_000.0, now=120.0)  # read at 5,000 on the actor's clock
    assert (here.reopen_at, here.paused_until) == (150.0, 122.0)
    assert (here.breaker, here.model) == (BreakerState.OPEN, "m")
    closed = Health(model="m", breaker=BreakerState.CLOSED)
    assert on_my_clock(closed, at=5_000.0, now=120.0) is closed  # no time to move
    assert on_my_clock(health, at=None, now=120.0) is health  # an older actor says no clock


def test_news_from_a_model_actor_of_another_callboard_keeps_its_fields() -> None:
    """A pickled dataclass's fields come back by position: ``at`` placed before
    ``streams`` had an older actor's streams read as its clock, and its ``lapsed`` as
    the streams (found by a review). Last, it is the one field either side may lack."""
    deltas = Deltas(task_id=1, attempt=1, call=1, seq=0, deltas=(StreamDelta(text="a"),))
    news = ModelNews(
        model="m", incarnation=2, answers=(), health=None, streams=(deltas,), lapsed=True, at=9.0
    )
    sent = [getattr(news, f.name) for f in dataclasses.fields(ModelNews) if f.name != "at"]
    older = object.__new__(ModelNews)
    older.__setstate__(sent)  # what an older actor pickles: its fields, in order, no ``at``
    assert (older.streams, older.lapsed, older.recall) == ((deltas,), True, False)
    assert clock_of(older) is None
    assert clock_of(news) == 9.0
    assert pickle.loads(pickle.dumps(news)) == news  # noqa: S301 - our own bytes


DIGEST = """
import json
from callboard import ModelSettings
from callboard.cluster._wire import settings_digest
m = ModelSettings(
    name="m",
    base_url="http://127.0.0.1:9/v1",
    api_key="sk-digest-0123456789abcdef",
    capabilities=frozenset({"vision", "json", "tools", "embeddings", "audio"}),
    headers={"x-b": "2", "x-a": "1"},
)
print(json.dumps(settings_digest(m)))
"""


def test_a_models_settings_digest_is_the_same_in_every_process() -> None:
    """Each process has its own string hash seed (a Ray worker too), and a set's repr
    is in its order: a model with two capabilities was told it was configured otherwise
    by the actor its own process made, and no call of it went on a lease (a hunt)."""
    digests = []
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        said = subprocess.run(  # noqa: S603 - this interpreter, our own script
            [sys.executable, "-c", DIGEST], env=env, capture_output=True, text=True, check=True
        )
        digests.append(json.loads(said.stdout))
    assert digests[0] == digests[1] == digests[2]
    assert "sk-digest" not in json.dumps(digests[0])


def test_a_settings_digest_tells_a_different_value_in_a_set_or_mapping_apart() -> None:
    base = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1")
    one = settings_digest(dataclasses.replace(base, capabilities=frozenset({"tools"})))
    two = settings_digest(dataclasses.replace(base, capabilities=frozenset({"tools", "json"})))
    assert one["capabilities"] != two["capabilities"]
    assert one["headers"] == two["headers"]
