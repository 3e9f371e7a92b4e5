"""Process crashes: a batch killed with SIGKILL resumes from its SQLite ledger."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from callboard.messages import Request, Task
from callboard.provider.server import SimulatedProvider
from callboard.runtime.sqlite_ledger import SqliteLedger
from support import WAIT_S, ProviderProcess, provider_process, two_models

from callboard import System, SystemConfig

LINES = 1500
CONCURRENCY = 50
WINDOW = 200


def wait_until(condition: Callable[[], bool], timeout: float) -> None:
    """Poll an outside condition (a file another process writes) until true or timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def slow_provider() -> Iterator[ProviderProcess]:
    proc = provider_process(latency_s=0.05, seed=11)
    yield proc
    proc.stop()


def run_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(  # noqa: S603 - our own CLI, fixed arguments
        [sys.executable, "-m", "callboard", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_mid_batch_then_resume(slow_provider: ProviderProcess, tmp_path: Path) -> None:
    config = tmp_path / "callboard.toml"
    config.write_text(
        f'[models.m]\nbase_url = "{slow_provider.base_url}"\nmax_concurrency = {CONCURRENCY}\n'
    )
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"q{i}"}) + "\n" for i in range(LINES))
    )
    out = tmp_path / "results.jsonl"
    args = (str(requests), "-o", str(out), "--config", str(config), "--window", str(WINDOW))

    first = run_cli(*args)
    wait_until(lambda: lines_in(out) >= 300, WAIT_S)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=WAIT_S)
    sent_before = slow_provider.stats()["total"]["requests"]
    assert sent_before < LINES  # it really died mid-run

    second = run_cli(*args)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err

    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    ids = Counter(r["id"] for r in records)
    assert set(ids) == {f"r{i}" for i in range(LINES)}
    assert max(ids.values()) == 1, [i for i, n in ids.items() if n > 1][:5]
    assert all(r["ok"] for r in records)
    repeated = slow_provider.stats()["total"]["requests"] - LINES
    # at-least-once towards the provider: only calls whose outcome was not yet
    # durable at the kill are sent again -- those in flight (at most the cap)
    # plus those finished but not yet committed; the run never has more than
    # its window of tasks unfinished, so that bounds the repeats
    assert 0 <= repeated <= WINDOW, repeated


def test_system_resumes_unfinished_tasks_from_the_ledger(
    provider: SimulatedProvider, tmp_path: Path
) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = SqliteLedger(path)
    for i in range(3):  # accepted by a process that then died: written, never finished
        request = Request.of(f"lost {i}", idempotency_key=f"k{i}")
        task = Task(task_id=ledger.next_id(), trace_id=f"t{i}", request=request, submitted_at=0.0)
        assert ledger.accept(task) is None
    ledger.close()
    probe = SqliteLedger(path)
    assert len(probe.unfinished()) == 3
    probe.close()

    with System(SystemConfig(models=two_models(provider.base_url)), ledger=path) as system:
        futures = system.resume()
        results = [f.result(WAIT_S) for f in futures]
    assert [r.ok for r in results] == [True, True, True]
    reopened = SqliteLedger(path)
    assert reopened.unfinished() == []
    assert reopened.result_for("k1") is not None
    reopened.close()


def test_a_key_accepted_again_after_a_cancel_takes_over_its_row(tmp_path: Path) -> None:
    from callboard.messages import Cancelled

    path = tmp_path / "keys.db"
    ledger = SqliteLedger(path)
    first = Task(
        task_id=ledger.next_id(),
        trace_id="t1",
        request=Request.of("old", idempotency_key="K"),
        submitted_at=0,
    )
    assert ledger.accept(first) is None
    ledger.finish(first, Cancelled(task_id=first.task_id, trace_id="t1"))
    ledger.close()
    ledger = SqliteLedger(path)  # a cancelled key may be used again after a restart
    again = Task(
        task_id=ledger.next_id(),
        trace_id="t2",
        request=Request.of("new", idempotency_key="K"),
        submitted_at=0,
    )
    assert ledger.accept(again) is None
    ledger.close()
    reopened = SqliteLedger(path)
    (row,) = reopened.stored()
    reopened.close()
    assert (row.task_id, row.request.messages[0].content, row.result) == (
        again.task_id,
        "new",
        None,
    )


def test_a_system_that_fails_to_start_releases_its_ledger(tmp_path: Path) -> None:
    from callboard import UnknownModelError

    path = tmp_path / "released.db"
    with pytest.raises(UnknownModelError):
        System(SystemConfig(escalate_to="nope"), ledger=path)
    with System(ledger=path) as system:  # the file is not held by the failed one
        assert system.submit("hi").result(WAIT_S).ok
