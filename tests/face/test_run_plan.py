"""What ``callboard run`` does with each line (callboard/_run_plan.py): every row of the
table in the module's header, with and without ``--retry-failed`` and
``--resend-changed``. Pure: no files, no system."""

from __future__ import annotations

import pytest
from callboard.messages import Completed, Failed, FailureReason

from callboard._run_plan import Action, Held, RunPlan
from callboard.batch import OutputState

NOW = "a" * 64
"""The digest of the line as it is now."""
BEFORE = "b" * 64
"""The digest of the request an earlier result answered, when the line changed."""

DONE = Completed(task_id=1, trace_id="t", content="x")
FAILED = Failed(task_id=2, trace_id="t", reason=FailureReason.AUTHENTICATION)


def plan(
    output: dict[str, tuple[str, str | None]] | None = None,
    ledger: dict[str, Held] | None = None,
    **flags: bool,
) -> RunPlan:
    """``output``: id -> (status, digest or None) of its last line."""
    state = OutputState()
    for ident, (status, digest) in (output or {}).items():
        state.statuses[ident] = status
        if digest is not None:
            state.digests[ident] = digest
    return RunPlan(output=state, ledger=ledger or {}, **flags)


def test_a_line_nothing_answered_is_sent() -> None:
    assert plan().action("q", NOW) is Action.SEND


def test_a_line_whose_error_record_is_all_there_is_is_sent() -> None:
    assert plan({"q": ("invalid", None)}).action("q", NOW) is Action.SEND


@pytest.mark.parametrize("status", ["completed", "failed", "expired", "rejected"])
def test_a_result_for_the_request_as_asked_now_stands(status: str) -> None:
    assert plan({"q": (status, NOW)}).action("q", NOW) is Action.SKIP


@pytest.mark.parametrize(
    ("status", "action"),
    [
        ("completed", Action.SKIP),
        ("failed", Action.RESEND),
        ("expired", Action.RESEND),
        ("rejected", Action.RESEND),
    ],
)
def test_retry_failed_sends_again_what_did_not_complete(status: str, action: Action) -> None:
    assert plan({"q": (status, NOW)}, retry_failed=True).action("q", NOW) is action


def test_a_changed_line_keeps_its_result_unless_asked_to_resend() -> None:
    output = {"q": ("completed", BEFORE)}
    assert plan(output).action("q", NOW) is Action.KEEP_CHANGED
    assert plan(output, retry_failed=True).action("q", NOW) is Action.KEEP_CHANGED
    assert plan(output, resend_changed=True).action("q", NOW) is Action.RESEND


def test_without_a_digest_in_the_output_the_ledgers_request_tells_a_change() -> None:
    ledger = {"q": Held(BEFORE, DONE)}
    assert plan({"q": ("completed", None)}, ledger).action("q", NOW) is Action.KEEP_CHANGED
    # the output's digest, where there is one, is what the line's result answered
    assert plan({"q": ("completed", NOW)}, ledger).action("q", NOW) is Action.SKIP


def test_with_no_digest_anywhere_a_result_stands() -> None:
    assert plan({"q": ("completed", None)}).action("q", NOW) is Action.SKIP


def test_the_ledgers_result_the_output_lacks_is_recovered_unless_retried_or_changed() -> None:
    assert plan(ledger={"q": Held(NOW, DONE)}).action("q", NOW) is Action.RECOVER
    assert plan(ledger={"q": Held(NOW, FAILED)}).action("q", NOW) is Action.RECOVER
    retried = plan(ledger={"q": Held(NOW, FAILED)}, retry_failed=True)
    assert retried.action("q", NOW) is Action.RESEND
    # the output never held the old answer: the line as it is now is sent, said or not
    assert plan(ledger={"q": Held(BEFORE, DONE)}).action("q", NOW) is Action.RESEND
