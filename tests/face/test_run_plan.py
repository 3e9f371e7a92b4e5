"""What ``callboard run`` does with each line (callboard/_run_plan.py): every row of the
table in the module's header, with and without ``--retry-failed`` and
``--resend-changed``. Pure: no files, no system."""

from __future__ import annotations

import pytest

from callboard._run_plan import Action, Held, RunPlan
from callboard.batch import OutputState

NOW = "a" * 64
"""The digest of the line as it is now."""
BEFORE = "b" * 64
"""The digest of the request an earlier result answered, when the line changed."""


def done(digest: str) -> Held:
    """The ledger holds a completed result for the request ``digest``."""
    return Held(digest, "completed")


def failed(digest: str) -> Held:
    return Held(digest, "failed")


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
    ledger = {"q": done(BEFORE)}
    assert plan({"q": ("completed", None)}, ledger).action("q", NOW) is Action.KEEP_CHANGED
    # the output's digest, where there is one, is what the line's result answered
    assert plan({"q": ("completed", NOW)}, ledger).action("q", NOW) is Action.SKIP


def test_with_no_digest_anywhere_a_result_stands() -> None:
    assert plan({"q": ("completed", None)}).action("q", NOW) is Action.SKIP


def test_the_ledgers_result_the_output_lacks_is_recovered_unless_retried_or_changed() -> None:
    assert plan(ledger={"q": done(NOW)}).action("q", NOW) is Action.RECOVER
    assert plan(ledger={"q": failed(NOW)}).action("q", NOW) is Action.RECOVER
    retried = plan(ledger={"q": failed(NOW)}, retry_failed=True)
    assert retried.action("q", NOW) is Action.RESEND
    # the output never held the old answer: the line as it is now is sent, said or not
    assert plan(ledger={"q": done(BEFORE)}).action("q", NOW) is Action.RESEND


def test_the_ledgers_result_replaces_an_error_record_of_the_line() -> None:
    assert plan({"q": ("invalid", None)}, {"q": done(NOW)}).action("q", NOW) is Action.RECOVER


@pytest.mark.parametrize("status", ["failed", "expired", "rejected"])
@pytest.mark.parametrize("retry_failed", [False, True])
def test_a_completed_result_in_the_ledger_replaces_a_failure_in_the_output(
    status: str, retry_failed: bool
) -> None:
    """A retry that completed, killed before its line was written: its answer is written,
    never paid for again, whatever the flags."""
    for recorded in (NOW, None):
        state = {"q": (status, recorded)}
        chosen = plan(state, {"q": done(NOW)}, retry_failed=retry_failed).action("q", NOW)
        assert chosen is Action.RECOVER


@pytest.mark.parametrize(
    ("output", "ledger"),
    [
        (("completed", NOW), failed(NOW)),  # never turn an answer into a failure
        (("completed", NOW), done(NOW)),  # the same answer, nothing to write
        (("failed", NOW), Held(NOW, "expired")),  # which failure is newer cannot be told
        (("failed", NOW), done(BEFORE)),  # the ledger's answers another line
    ],
)
def test_the_outputs_result_for_the_line_as_it_is_stands_otherwise(
    output: tuple[str, str], ledger: Held
) -> None:
    assert plan({"q": output}, {"q": ledger}).action("q", NOW) is Action.SKIP


@pytest.mark.parametrize("flags", [{}, {"resend_changed": True}])
def test_the_ledgers_answer_to_a_changed_line_replaces_the_outputs_old_one(
    flags: dict[str, bool],
) -> None:
    """``--resend-changed`` sent the line again, killed before its line was written: the
    ledger answers the line as it is now, the output a line that is no more."""
    output = {"q": ("completed", BEFORE)}
    assert plan(output, {"q": done(NOW)}, **flags).action("q", NOW) is Action.RECOVER
    assert plan(output, {"q": failed(NOW)}, **flags).action("q", NOW) is Action.RECOVER
    retried = plan(output, {"q": failed(NOW)}, retry_failed=True, **flags)
    assert retried.action("q", NOW) is Action.RESEND
    # the ledger's answers the old line too: nothing newer than the output's
    assert plan(output, {"q": done(BEFORE)}, **flags).action("q", NOW) is (
        Action.RESEND if flags else Action.KEEP_CHANGED
    )
