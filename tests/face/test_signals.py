"""``callboard._signals``: a noted signal is raised only where the main thread asks."""

from __future__ import annotations

import signal

import pytest

from callboard._signals import Interrupts, Terminated, handling


def test_a_noted_signal_raises_only_at_check_and_the_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    interrupts = Interrupts()
    with interrupts.noted():
        interrupts.check()  # nothing yet
        signal.raise_signal(signal.SIGINT)  # handled here, and nothing is raised
        signal.raise_signal(signal.SIGINT)
        assert interrupts.sigints == 2
        with pytest.raises(KeyboardInterrupt) as raised:
            interrupts.check()
        assert type(raised.value) is KeyboardInterrupt
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_sigterm_first_is_raised_as_terminated() -> None:
    interrupts = Interrupts()
    with interrupts.noted():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(Terminated):
            interrupts.check()
    assert interrupts.sigints == 1


def test_a_sighup_first_is_raised_as_terminated() -> None:
    """The terminal closed (an SSH session dropped): stop as SIGTERM stops. Its default
    ended a run at once, its calls in flight lost (found by a hunt of the gateway's)."""
    interrupts = Interrupts()
    with interrupts.noted():
        signal.raise_signal(signal.SIGHUP)
        assert interrupts.terminated
        with pytest.raises(Terminated):
            interrupts.check()


def test_from_raise_at_on_the_handler_raises_at_once() -> None:
    """Where the main thread shares no lock (the run's tidy-up of a large output), a
    second signal cuts the work short rather than wait for it unheard (found by a
    review)."""
    interrupts = Interrupts()
    with interrupts.noted():
        signal.raise_signal(signal.SIGINT)  # noted
        interrupts.raise_at = 2
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGTERM)
    assert interrupts.count == 3


@pytest.mark.parametrize("ignored", [signal.SIGHUP, signal.SIGINT], ids=["nohup", "background"])
def test_a_signal_the_process_was_started_ignoring_stays_ignored(
    ignored: signal.Signals,
) -> None:
    """Under ``nohup`` a dropped session must not stop a run: SIGHUP was taken over
    regardless, and ``nohup callboard run`` stopped when its terminal closed (a review).
    A background job of a non-interactive shell starts with SIGINT ignored: taken over,
    a Ctrl-C meant for the foreground stopped the run in the background (found by a
    hunt). Python leaves such a signal ignored, and so does callboard; the others are
    heeded as ever."""
    with handling(signal.SIG_IGN, ignored):
        interrupts = Interrupts()
        with interrupts.noted():
            assert signal.getsignal(ignored) is signal.SIG_IGN
            signal.raise_signal(ignored)
            interrupts.check()  # nothing came
            signal.raise_signal(signal.SIGTERM)
            assert interrupts.terminated
        assert interrupts.count == 1
