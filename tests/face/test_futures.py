"""``callboard._futures``: the patterns' waits over part futures. A ``System``'s futures
end in a result or a cancel; a ``Submitter`` of the user's may end one in an exception,
which must reach the pattern's waiter, not escape the done-callback and leave it
waiting for ever (found by a hunt)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from callboard.messages import Result
from support import WAIT_S

from callboard._futures import Decider, collect


class SubmitterError(Exception):
    pass


def test_a_part_that_ends_in_an_exception_decides_a_race_with_it() -> None:
    parts: list[Future[Result]] = [Future(), Future()]
    decider = Decider(parts, lambda r: r.ok)
    parts[0].set_exception(SubmitterError("the submitter's own failure"))
    with pytest.raises(SubmitterError):
        decider.decided.result(WAIT_S)
    assert decider.index == 0


def test_a_part_that_ends_in_an_exception_ends_a_gather_with_it() -> None:
    parts: list[Future[Result]] = [Future(), Future()]
    gathered = collect(parts)
    parts[0].set_exception(SubmitterError("the submitter's own failure"))
    parts[1].cancel()
    with pytest.raises(SubmitterError):
        gathered.result(WAIT_S)
