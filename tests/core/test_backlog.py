"""Backlog: what a model actor holds unsent, in the order it is to go (pure)."""

from __future__ import annotations

from callboard.core.backlog import Backlog
from callboard.messages import Job, Request, Task


def job(task_id: int) -> Job:
    task = Task(task_id=task_id, trace_id=f"t{task_id}", request=Request.of("x"), submitted_at=0.0)
    return Job(task=task, candidates=("m",))


def ids(jobs: tuple[Job, ...] | list[Job]) -> list[int]:
    return [j.task.task_id for j in jobs]


def test_due_retries_go_to_the_head_of_the_waiting_line_in_due_order() -> None:
    held = Backlog()
    held.waiting.extend([job(1), job(2)])
    held.retry_at(5.0, job(3))
    held.retry_at(4.0, job(4))
    held.retry_at(9.0, job(5))
    assert held.next_retry() == 4.0
    held.release_due(5.0)
    assert ids(list(held.waiting)) == [4, 3, 1, 2]
    assert held.next_retry() == 9.0


def test_taking_everything_empties_both_places_waiting_first() -> None:
    # What a model whose breaker opened hands back to the queue: nothing stays held.
    held = Backlog()
    line = held.waiting
    line.extend([job(1), job(2)])
    held.retry_at(7.0, job(3))
    held.retry_at(6.0, job(4))
    assert ids(held.take_all()) == [1, 2, 4, 3]
    assert (len(held.waiting), held.retrying, held.next_retry()) == (0, [], None)
    assert held.waiting is line  # the same deque throughout
    assert held.take_all() == ()
