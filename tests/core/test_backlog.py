"""Backlog (core/backlog.py, pure): what a model actor holds unsent, in the order it is
to go: the waiting line, and the retries held off the cap until they are due."""

from __future__ import annotations

from callboard.core.backlog import Backlog
from callboard.messages import Job, Request, Task


def job(task_id: int, deadline_at: float | None = None) -> Job:
    task = Task(
        task_id=task_id,
        trace_id=f"t{task_id}",
        request=Request.of("x"),
        submitted_at=0.0,
        deadline_at=deadline_at,
    )
    return Job(task=task, candidates=("m",))


def ids(jobs: tuple[Job, ...] | list[Job]) -> list[int]:
    return [j.task.task_id for j in jobs]


def test_due_retries_are_taken_out_in_due_order_and_the_line_stays() -> None:
    held = Backlog()
    held.waiting.extend([job(1), job(2)])
    held.retry_at(5.0, job(3))
    held.retry_at(4.0, job(4))
    held.retry_at(9.0, job(5))
    assert held.next_retry() == 4.0
    assert ids(held.take_due(5.0)) == [4, 3]
    assert ids(list(held.waiting)) == [1, 2]
    assert held.next_retry() == 9.0


def test_taking_the_retries_leaves_the_waiting_line() -> None:
    # What a model whose breaker opened hands back after its waiting line: both go.
    held = Backlog()
    line = held.waiting
    line.extend([job(1), job(2)])
    held.retry_at(7.0, job(3))
    held.retry_at(6.0, job(4))
    assert ids(held.take_retrying()) == [4, 3]  # in due order
    assert (held.retrying, held.next_retry()) == ([], None)
    assert ids(list(held.waiting)) == [1, 2]
    assert held.waiting is line  # the same deque throughout
    assert held.take_retrying() == ()


def test_taking_the_waiting_line_leaves_the_retries() -> None:
    held = Backlog()
    held.waiting.extend([job(1), job(2)])
    held.retry_at(3.0, job(3))
    assert ids(held.take_waiting()) == [1, 2]
    assert len(held.waiting) == 0
    assert held.next_retry() == 3.0


def test_a_retry_not_yet_due_stays_off_the_line() -> None:
    held = Backlog()
    held.retry_at(5.0, job(1))
    assert held.take_due(4.9) == ()
    assert ids(list(held.waiting)) == []
    assert held.next_retry() == 5.0


def test_pulling_takes_each_job_the_pick_answers_for_and_keeps_the_rest_in_order() -> None:
    held = Backlog()
    line = held.waiting
    line.extend(job(i) for i in range(1, 6))
    seen: list[int] = []

    def pick(j: Job) -> str | None:
        seen.append(j.task.task_id)
        return "odd" if j.task.task_id % 2 else None

    pulled = held.pull_waiting(pick)
    assert [(j.task.task_id, answer) for j, answer in pulled] == [
        (1, "odd"),
        (3, "odd"),
        (5, "odd"),
    ]
    assert ids(list(held.waiting)) == [2, 4]
    assert seen == [1, 2, 3, 4, 5]  # each once
    assert held.waiting is line


def test_the_next_deadline_is_the_soonest_among_the_waiting() -> None:
    held = Backlog()
    assert held.next_deadline() is None
    held.waiting.extend([job(1), job(2, deadline_at=9.0), job(3, deadline_at=4.0)])
    held.retry_at(1.0, job(4, deadline_at=2.0))  # retries wait off the line: not counted
    assert held.next_deadline() == 4.0


def test_dropping_takes_from_both_places_and_keeps_the_retry_order() -> None:
    held = Backlog()
    line = held.waiting
    line.extend([job(1), job(2), job(3)])
    for at, i in ((5.0, 4), (2.0, 5), (7.0, 6), (1.0, 7)):
        held.retry_at(at, job(i))
    dropped = held.drop(lambda j: j.task.task_id in {2, 5, 7})
    assert ids(dropped)[0] == 2  # the waiting ones first, then the retrying ones
    assert sorted(ids(dropped)) == [2, 5, 7]
    assert ids(list(held.waiting)) == [1, 3]
    assert held.waiting is line
    assert held.next_retry() == 5.0
    assert ids(held.take_due(10.0)) == [4, 6]
    assert ids(list(held.waiting)) == [1, 3]
    assert held.drop(lambda j: False) == []


def test_a_job_is_in_one_place_at_most() -> None:
    held = Backlog()
    held.waiting.extend([job(1)])
    held.retry_at(1.0, job(2))
    assert ids(held.take_due(1.0)) == [2]
    assert ids(list(held.waiting)) == [1]
    assert held.retrying == []
