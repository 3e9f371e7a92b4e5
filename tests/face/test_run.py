"""``callboard run`` as people use it (callboard/_run_output.py, _run_batch.py, cli.py):
damaged ledgers and outputs end in exit 2 naming the file, what is wrong and what to do;
``--rebuild-ledger`` sends no finished work again; ``--retry-failed`` and
``--resend-changed`` send again what the output holds, and without them the run says
how; a result the ledger committed but the output lost, or holds an older line for,
is written without sending, and only those results are read whole; ``-`` is stdin and
stdout; a fixed line's stale ``line-N`` record goes; an unpriced model's cost is
unknown, not $0.

Real parts: the CLI in process (``main``) against the simulated provider on loopback
(counting what reaches it), or as a subprocess where stdin and stdout are the point.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import os
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from callboard.core.tokens import text_tokens
from callboard.messages import Result
from callboard.provider.embeddings import vector
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from callboard.runtime import sqlite_ledger
from callboard.runtime.sqlite_ledger import SqliteLedger
from loopback import Gate, WireServer, answer
from support import (
    CLI_TIMEOUT_S,
    INTERRUPTIBLE,
    damaged_commits,
    dead_port,
    good,
    records,
    requests_seen,
    wait_until,
    write_lines,
)

from callboard import _progress, _run_batch, cli
from callboard.cli import main

IDS = ["a", "b", "c"]


def config(path: Path, base_url: str, *, priced: bool = True) -> Path:
    """One model ``m`` at ``base_url``."""
    price = 'price = { input = "1.00", output = "2.00" }\n' if priced else ""
    path.write_text(f'[models.m]\nbase_url = "{base_url}"\n{price}', encoding="utf-8")
    return path


class Run:
    """``callboard run IN -o OUT --config C`` in process, on ``provider``; each call
    returns (exit status, stderr) and what it sent."""

    def __init__(
        self,
        tmp_path: Path,
        provider: SimulatedProvider,
        capsys: pytest.CaptureFixture[str],
        *,
        priced: bool = True,
    ) -> None:
        self.input = tmp_path / "in.jsonl"
        self.output = tmp_path / "out.jsonl"
        self.ledger = tmp_path / "out.jsonl.ledger"
        self.config = config(tmp_path / "c.toml", provider.base_url, priced=priced)
        self.provider = provider
        self.capsys = capsys
        self.sent = 0
        """Requests the last call sent."""

    def lines(self, lines: list[Any]) -> Run:
        write_lines(self.input, lines)
        return self

    def __call__(self, *extra: str) -> tuple[int, str]:
        before = requests_seen(self.provider)
        argv = ["run", str(self.input), "-o", str(self.output), "--config", str(self.config)]
        code = main([*argv, *extra])
        self.sent = requests_seen(self.provider) - before
        err = self.capsys.readouterr().err
        assert "Traceback" not in err, err
        return code, err

    def command(self, flag: str) -> str:
        """The exact command a hint should print."""
        return f"callboard run {self.input} -o {self.output} --config {self.config} {flag}"


@pytest.fixture
def run(tmp_path: Path, provider: SimulatedProvider, capsys: pytest.CaptureFixture[str]) -> Run:
    return Run(tmp_path, provider, capsys)


@pytest.fixture
def finished(run: Run) -> Run:
    """A run of ``IDS`` that completed every one."""
    code, err = run.lines([good(i) for i in IDS])()
    assert code == 0, err
    assert run.sent == len(IDS)
    return run


def by_id(path: Path) -> dict[str, dict[str, Any]]:
    """Each id's last record; and every id has exactly one."""
    recs = records(path)
    assert Counter(r["id"] for r in recs).most_common(1)[0][1] == 1, recs
    return {r["id"]: r for r in recs}


def result_count(err: str) -> int:
    """The N of the summary's 'callboard: N results in ...'."""
    (line,) = [x for x in err.splitlines() if " results in " in x]
    return int(line.split()[1])


# -- embeddings lines ---------------------------------------------------------------------------

EMBEDDER = """\
[models.m]
base_url = "{url}"
price = {{ input = "1.00", output = "2.00" }}
[models.e]
base_url = "{url}"
capabilities = ["embeddings"]
price = {{ input = "1.00", output = "0" }}
embedding_batch_size = 4
"""
"""A chat model and an embeddings model (four texts a call) on the simulated provider."""


@pytest.fixture
def embedding_run(run: Run) -> Run:
    run.config.write_text(EMBEDDER.format(url=run.provider.base_url), encoding="utf-8")
    return run


EMBEDDING_LINES: list[Any] = [
    {"id": "one", "input": "a single text", "dimensions": 4},
    {"id": "many", "input": ["first", "second", "third"], "dimensions": 3, "priority": "high"},
    {
        "custom_id": "openai",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "e", "input": ["x", "y"], "dimensions": 2, "encoding_format": "base64"},
    },
    good("chat"),
]


def oracle(text: str, dimensions: int) -> list[float]:
    """What the simulated provider embeds ``text`` as."""
    return vector(text.encode(), dimensions)


def test_embedding_lines_in_both_shapes_get_their_vectors(embedding_run: Run) -> None:
    run = embedding_run
    code, err = run.lines(EMBEDDING_LINES)()
    assert (code, run.sent) == (0, 4), err
    out = by_id(run.output)
    assert out["one"]["embedding"] == oracle("a single text", 4)
    assert out["many"]["embeddings"] == [oracle(t, 3) for t in ("first", "second", "third")]
    tokens = sum(text_tokens(t) for t in ("first", "second", "third"))
    assert out["many"]["usage"]["prompt_tokens"] == tokens  # as estimated
    assert out["many"]["cost_usd"] == str(Decimal(tokens) / 10**6)
    assert out["many"]["model"] == "e", "the model that embeds, chosen for a line naming none"
    packed = out["openai"]["embeddings"]  # asked for base64: written as sent
    assert [list(struct.unpack("<2f", base64.b64decode(v))) for v in packed] == [
        oracle("x", 2),
        oracle("y", 2),
    ]
    assert out["chat"]["text"]
    assert all("text" not in out[i] for i in ("one", "many", "openai"))


def test_an_embedding_line_naming_no_model_is_unchanged_by_a_change_of_config(
    embedding_run: Run,
) -> None:
    """Its digest was taken after callboard chose its model: with the config's models
    in another order (or one added first) the unchanged line was "changed" (exit 1, a
    hint to pay for it again), and with no embeddings model left the completed line
    failed its check (found by a hunt). What the line asked is its own."""
    run = embedding_run
    code, err = run.lines(EMBEDDING_LINES)()
    assert code == 0, err
    url = run.provider.base_url
    first = f'[models.e0]\nbase_url = "{url}"\ncapabilities = ["embeddings"]\n'
    run.config.write_text(first + EMBEDDER.format(url=url), encoding="utf-8")
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert "changed" not in err
    run.config.write_text(  # no embeddings model at all: only chat lines could go
        f'[models.m]\nbase_url = "{run.provider.base_url}"\n', encoding="utf-8"
    )
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert "not sent" not in err


def test_a_result_an_earlier_callboard_wrote_with_the_chosen_models_digest_still_stands(
    embedding_run: Run,
) -> None:
    """Outputs written before held the digest of the request as sent, model chosen: it
    still answers the line, not "changed"."""
    run = embedding_run
    code, err = run.lines(EMBEDDING_LINES[:1])()
    assert code == 0, err
    (record,) = records(run.output)
    ledger = SqliteLedger(run.ledger)  # it holds the request as sent, its model chosen
    try:
        record["request_sha256"] = ledger.kept()["one"].digest
    finally:
        ledger.close()
    assert record["request_sha256"] != records(run.output)[0]["request_sha256"]
    run.output.write_text(json.dumps(record) + "\n", encoding="utf-8")
    run.ledger.unlink()  # the output alone says what was asked
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert "changed" not in err


def test_embedding_lines_resume_and_a_changed_input_is_a_changed_line(embedding_run: Run) -> None:
    run = embedding_run
    code, err = run.lines(EMBEDDING_LINES)()
    assert code == 0, err
    old = by_id(run.output)
    code, err = run()
    assert (code, run.sent) == (0, 0), err

    changed = [*EMBEDDING_LINES]
    changed[1] = {**changed[1], "input": ["first", "second", "fourth"]}
    code, err = run.lines(changed)()
    assert (code, run.sent) == (1, 0), err
    assert "(ids: many)" in err
    code, err = run("--resend-changed")
    assert (code, run.sent) == (0, 1), err
    assert by_id(run.output)["many"]["embeddings"][2] == oracle("fourth", 3)
    assert by_id(run.output)["one"] == old["one"]


def test_embedding_results_the_output_lost_come_back_from_the_ledger(embedding_run: Run) -> None:
    run = embedding_run
    code, err = run.lines(EMBEDDING_LINES)()
    assert code == 0, err
    old = by_id(run.output)
    write_lines(run.output, [r for r in records(run.output) if r["id"] == "chat"])
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    recovered = by_id(run.output)
    for ident in ("one", "many", "openai"):  # the vectors, as they were written first
        for key in ("embedding", "embeddings"):
            assert recovered[ident].get(key) == old[ident].get(key), (ident, key)


def test_an_embeddings_line_larger_than_one_call_is_invalid_and_the_rest_run(
    embedding_run: Run,
) -> None:
    run = embedding_run
    big = {"id": "big", "input": ["t"] * 5}
    code, err = run.lines([big, EMBEDDING_LINES[0]])()
    assert (code, run.sent) == (1, 1), err
    out = by_id(run.output)
    assert out["big"]["status"] == "invalid"
    assert "split the line" in out["big"]["error"]["detail"]
    assert "one embeddings call takes at most 4 texts" in err
    assert out["one"]["ok"]


def test_an_embeddings_line_with_no_model_to_serve_it_is_invalid(run: Run) -> None:
    code, err = run.lines([{"id": "e", "input": "text"}, good("a")])()
    assert (code, run.sent) == (1, 1), err
    assert "embeddings need a model" in by_id(run.output)["e"]["error"]["detail"]


# -- a damaged ledger --------------------------------------------------------------------------


def _bad_rows(ledger: Path, output: Path) -> str:
    with contextlib.closing(sqlite3.connect(ledger)) as db, db:
        db.execute("UPDATE tasks SET result = '{bad' WHERE key IN ('a', 'c')")
    return "2 of its rows cannot be read"


def _emptied(ledger: Path, output: Path) -> str:
    ledger.write_bytes(b"")
    return f"is empty (0 bytes) but {output} holds results"


def _emptied_beside_its_log(ledger: Path, output: Path) -> str:
    """A 0-byte ledger with a write-ahead log beside it was taken as a crash's (the log
    to finish it): SQLite discarded the log, and every line was sent again (found by a
    hunt). No crash leaves one: SQLite writes the main file's header first."""
    ledger.with_name(ledger.name + "-wal").write_bytes(b"\x37\x7f\x06\x82" + bytes(4092))
    return _emptied(ledger, output)


def _garbage(ledger: Path, output: Path) -> str:
    ledger.write_bytes(b"\x17garbage, not a database\n" * 300)
    return "is not a SQLite database"


def _text(ledger: Path, output: Path) -> str:
    """Text where the ledger beside the output was (an editor, a copy gone wrong): it is
    no ledger given by mistake, and ``--rebuild-ledger`` said 'give --ledger another
    path', which was never given (found by a hunt of the docs)."""
    ledger.write_text("not a ledger any more\n", encoding="utf-8")
    return "is a text file, not a ledger"


@pytest.mark.parametrize(
    "damage",
    [_bad_rows, _emptied, _emptied_beside_its_log, _garbage, _text],
    ids=lambda f: f.__name__[1:],
)
def test_a_damaged_ledger_is_exit_2_naming_it_and_a_rebuild_sends_nothing_finished(
    finished: Run, damage: Any
) -> None:
    run = finished
    what = damage(run.ledger, run.output)
    output_before = run.output.read_bytes()

    code, err = run()
    assert code == 2, err
    assert err.startswith("callboard: error: "), err
    assert str(run.ledger) in err
    assert what in err
    assert "--rebuild-ledger" in err
    assert run.sent == 0
    assert run.output.read_bytes() == output_before

    code, err = run("--rebuild-ledger")
    assert code == 0, err
    assert run.sent == 0, "finished work was sent again"
    assert run.output.read_bytes() == output_before
    assert f"set the ledger aside as {run.ledger}.damaged" in err
    assert (run.ledger.parent / (run.ledger.name + ".damaged")).exists(), "nothing deleted"
    code, err = run()  # the rebuilt ledger is a ledger
    assert (code, run.sent) == (0, 0), err


def test_bad_rows_fail_the_run_even_when_the_output_is_complete(finished: Run) -> None:
    _bad_rows(finished.ledger, finished.output)
    code, err = finished()
    assert code == 2, err
    assert "task " in err
    assert "key 'a'" in err


def test_another_applications_database_as_ledger_is_refused_and_never_moved(
    finished: Run,
) -> None:
    theirs = finished.ledger.parent / "theirs.db"
    with contextlib.closing(sqlite3.connect(theirs)) as db, db:
        db.execute("CREATE TABLE accounts (name TEXT)")
    before = theirs.read_bytes()
    for extra in ((), ("--rebuild-ledger",)):
        code, err = finished("--ledger", str(theirs), *extra)
        assert code == 2, err
        assert "not a callboard ledger (its tables: accounts)" in err
        assert "give --ledger another path" in err
        assert finished.sent == 0
    assert theirs.read_bytes() == before


def test_a_text_file_as_ledger_is_refused_and_never_moved(finished: Run) -> None:
    """Another run's results given as ``--ledger``: the error said to rebuild it, and
    ``--rebuild-ledger`` set the results aside and put a ledger in their place."""
    theirs = finished.ledger.parent / "other-results.jsonl"
    theirs.write_text('{"id": "x", "status": "completed"}\n', encoding="utf-8")
    before = theirs.read_bytes()
    for extra in ((), ("--rebuild-ledger",)):
        code, err = finished("--ledger", str(theirs), *extra)
        assert code == 2, err
        assert "is a text file, not a ledger" in err
        assert "--rebuild-ledger" not in err
        assert finished.sent == 0
    assert theirs.read_bytes() == before
    assert not (theirs.parent / (theirs.name + ".damaged")).exists()


def test_a_0_byte_ledger_beside_an_output_with_no_results_is_a_new_ledger(run: Run) -> None:
    """Nothing can have been lost (``touch`` made it, or a run that sent nothing)."""
    run.lines([good(i) for i in IDS])
    run.output.write_text("", encoding="utf-8")
    run.ledger.write_bytes(b"")
    code, err = run()
    assert (code, run.sent) == (0, 3), err


# -- a damaged output --------------------------------------------------------------------------


def test_garbage_in_the_middle_of_the_output_is_exit_2_naming_the_file_and_line(
    finished: Run,
) -> None:
    lines = finished.output.read_bytes().splitlines(keepends=True)
    damaged = lines[0] + b"\x00\x00\x00\x00 disk garbage\n" + b"".join(lines[1:])
    finished.output.write_bytes(damaged)
    code, err = finished()
    assert code == 2, err
    assert f"{finished.output} is damaged: line 2 between its result records" in err
    assert finished.sent == 0
    assert finished.output.read_bytes() == damaged, "a damaged output is not touched"
    assert not finished.output.with_name("out.jsonl.compacting").exists()


# -- failed results, sent again --------------------------------------------------------------


def test_failed_results_are_kept_the_summary_says_how_to_retry_and_retry_failed_does(
    run: Run,
) -> None:
    run.provider.configure("m", ModelBehaviour(latency_s=0.0, status=400))
    code, err = run.lines([good(i) for i in IDS])()
    assert code == 1, err
    assert "3 ids did not complete (failed 3)" in err
    assert run.command("--retry-failed") in err

    run.provider.configure("m", ModelBehaviour(latency_s=0.005))  # the outage is over
    code, err = run()
    assert (code, run.sent) == (1, 0), "without the flag a failure is kept"
    assert run.command("--retry-failed") in err

    code, err = run("--retry-failed")
    assert code == 0, err
    assert run.sent == 3
    assert result_count(err) == 3
    assert "3 of them sent again" in err
    assert {i: r["status"] for i, r in by_id(run.output).items()} == dict.fromkeys(IDS, "completed")
    code, err = run("--retry-failed")  # completed ones are kept
    assert (code, run.sent) == (0, 0), err


def test_lines_sent_again_and_cancelled_are_not_counted_as_sent_again(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupted ``--retry-failed`` said "40 of them sent again" of 27 results
    written, the rest cancelled (found by a hunt): what it counts is what it wrote."""
    run.provider.configure("m", ModelBehaviour(latency_s=0.0, status=400))
    code, err = run.lines([good(i) for i in IDS])()
    assert code == 1, err
    run.provider.configure("m", ModelBehaviour(latency_s=0.005))
    stop = cli.stop_interrupted

    def at_once(*args: Any) -> None:  # the second Ctrl-C, as the stop begins
        signal.raise_signal(signal.SIGINT)
        stop(*args)

    monkeypatch.setattr(cli, "stop_interrupted", at_once)

    def ctrl_c() -> None:  # once the three are on the wire, held there
        if wait_until(lambda: run.provider.stats()["models"]["m"]["in_flight"] == 3):
            os.kill(os.getpid(), signal.SIGINT)

    with run.provider.held("m"):
        interrupter = threading.Thread(target=ctrl_c)
        interrupter.start()
        code, err = run("--retry-failed")
        interrupter.join()
    assert code == 130, err
    assert result_count(err) == 0
    assert "3 cancelled or left unsent, not written" in err
    assert "sent again" not in err


def test_retry_failed_sends_only_the_failed_ones(run: Run) -> None:
    code, _ = run.lines([good("a")])()
    assert code == 0
    run.provider.configure("m", ModelBehaviour(latency_s=0.0, status=400))
    code, _ = run.lines([good("a"), good("b")])()
    assert code == 1
    run.provider.configure("m", ModelBehaviour(latency_s=0.005))
    code, err = run("--retry-failed")
    assert (code, run.sent) == (0, 1), err
    assert "1 already done, skipped" in err


# -- lines that changed since their result ------------------------------------------------------


def test_a_changed_line_is_said_loudly_kept_and_resent_only_when_asked(finished: Run) -> None:
    run = finished
    old = by_id(run.output)
    run.lines([good("a"), good("b", "something else entirely"), {**good("c"), "priority": "high"}])

    code, err = run()
    assert code == 1, "the output does not answer the input as it is now"
    assert run.sent == 0
    assert "WARNING: 1 input line(s) changed since their result was written" in err
    assert "(ids: b)" in err, "a priority is not a change of what is asked"
    assert run.command("--resend-changed") in err
    assert by_id(run.output) == old

    code, err = run("--resend-changed")
    assert (code, run.sent) == (0, 1), err
    new = by_id(run.output)
    assert new["b"]["request_sha256"] != old["b"]["request_sha256"]
    assert new["a"] == old["a"]
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert "WARNING" not in err


def test_a_changed_line_that_now_fails_its_check_keeps_its_result_and_sends_nothing(
    finished: Run,
) -> None:
    """Sent again with ``--resend-changed`` while it now names a model the config lacks,
    it left two lines for its id (the result, then an error), and the summary said it
    was sent (found by a hunt). Its result stands, as for a line that no longer parses."""
    run = finished
    old = by_id(run.output)
    run.lines([good("a"), {**good("b", "changed"), "model": "absent"}, good("c")])
    code, err = run("--resend-changed")
    assert run.sent == 0
    assert "not sent: the result its id 'b' has from an earlier run stands" in err
    assert "sent again" not in err
    assert by_id(run.output) == old  # one line per id, each as it was
    assert code != 0  # the input's line b is not answered as it is now


@pytest.mark.parametrize("blank", [" ", "\t", "\u00a0", "\u2028"], ids=["sp", "tab", "nbsp", "ls"])
def test_an_id_of_blanks_is_that_lines_error_and_the_rest_run(run: Run, blank: str) -> None:
    """An id of spaces passed the id check, and the ledger's key refused it as the line
    was sent: every run of the batch stopped there, the lines before it paid for and not
    written (found by a hunt)."""
    code, err = run.lines([good("a"), {**good("x"), "id": blank}, good("b")])()
    assert code == 1, err
    assert run.sent == 2
    recs = records(run.output)
    assert {r["id"]: r["status"] for r in recs if r["status"] == "completed"} == {
        "a": "completed",
        "b": "completed",
    }
    (error,) = [r for r in recs if r["status"] == "invalid"]
    assert "id must be a non-empty string" in error["error"]["detail"]


def test_a_change_is_found_from_the_ledger_when_the_output_has_no_digest(finished: Run) -> None:
    """An output written before results carried their request's digest."""
    run = finished
    lines = [{k: v for k, v in r.items() if k != "request_sha256"} for r in records(run.output)]
    write_lines(run.output, lines)
    run.lines([good("a", "a new question"), good("b"), good("c")])
    code, err = run()
    assert (code, run.sent) == (1, 0), err
    assert "(ids: a)" in err


def test_the_ledgers_result_the_output_lost_is_written_without_sending(finished: Run) -> None:
    """A crash between the ledger's commit and the output's write: the rerun recovers
    those results from the ledger; the summary counts each id once."""
    run = finished
    keep = [r for r in records(run.output) if r["id"] == "a"]
    write_lines(run.output, keep)
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert result_count(err) == 2
    assert "1 already done, skipped" in err
    # recovered, not this run's spend: the summary said this run spent the first's money
    # and showed its tokens and latencies (found by a hunt)
    assert "2 of them from the ledger, not sent" in err
    assert "callboard run: per model" not in err  # no figures of this run's calls: none
    assert set(by_id(run.output)) == set(IDS)


@pytest.mark.parametrize("flags", [(), ("--retry-failed",)], ids=["plain", "retry-failed"])
def test_a_retry_that_completed_but_lost_its_line_is_written_never_paid_again(
    run: Run, flags: tuple[str, ...]
) -> None:
    """``--retry-failed`` sends an id again, the ledger commits its answer, and the run is
    killed before the line is written: the output still says failed. The next run writes
    the ledger's answer in place of the failure, sending nothing, with or without the
    flag; the output keeps one line per id."""
    run.provider.configure("m", ModelBehaviour(latency_s=0.0, status=400))
    code, _ = run.lines([good(i) for i in IDS])()
    assert code == 1
    failed_output = run.output.read_bytes()
    run.provider.configure("m", ModelBehaviour(latency_s=0.005))
    code, err = run("--retry-failed")
    assert (code, run.sent) == (0, 3), err
    answered = by_id(run.output)
    run.output.write_bytes(failed_output)  # the kill: in the ledger, not yet in the output

    code, err = run(*flags)
    assert (code, run.sent) == (0, 0), err
    assert by_id(run.output) == answered, "the answers the ledger kept, as first written"
    assert result_count(err) == 3
    assert "did not complete" not in err
    assert not run.output.with_name("out.jsonl.compacting").exists()


def test_a_changed_line_sent_again_but_lost_is_written_never_paid_again(finished: Run) -> None:
    """``--resend-changed`` killed before the new answer's line was written: the output
    answers the old line, the ledger the line as it is now. The next run writes the
    ledger's, sends nothing and warns of no change."""
    run = finished
    old_output = run.output.read_bytes()
    run.lines([good("a"), good("b", "something else entirely"), good("c")])
    code, err = run("--resend-changed")
    assert (code, run.sent) == (0, 1), err
    answered = by_id(run.output)
    run.output.write_bytes(old_output)

    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert "WARNING" not in err
    assert by_id(run.output) == answered
    code, err = run("--resend-changed")
    assert (code, run.sent) == (0, 0), err


def test_the_plan_decodes_only_the_results_it_recovers(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run starts from each id's request digest and status; a result is read whole
    only when it is written from the ledger, so memory does not grow with the output."""
    ids = [f"q{n}" for n in range(40)]
    code, err = run.lines([good(i) for i in ids])()
    assert (code, run.sent) == (0, 40), err
    lost = {"q7", "q31"}
    write_lines(run.output, [r for r in records(run.output) if r["id"] not in lost])
    decoded: list[str] = []
    real = sqlite_ledger.result_from_json

    def counting(text: str) -> Result:
        decoded.append(text)
        return real(text)

    monkeypatch.setattr(sqlite_ledger, "result_from_json", counting)
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert result_count(err) == 2
    assert set(by_id(run.output)) == set(ids)
    assert len(decoded) == 2, "each recovered result once, no other"


def test_a_result_the_ledger_cannot_read_back_is_said_and_sent_again(finished: Run) -> None:
    """A row whose result is JSON of the wrong shape passes the plan's check (SQLite reads
    its type) and fails when it is read whole: that id is asked again, and said so."""
    run = finished
    write_lines(run.output, [r for r in records(run.output) if r["id"] != "c"])
    with contextlib.closing(sqlite3.connect(run.ledger)) as db, db:
        db.execute("""UPDATE tasks SET result = '{"type": "Completed"}' WHERE key = 'c'""")
    code, err = run()
    assert (code, run.sent) == (0, 1), err
    assert f"the ledger {run.ledger} is damaged" in err
    assert "c is sent again" in err
    assert "1 of them sent again" in err
    assert by_id(run.output)["c"]["status"] == "completed"
    code, err = run()  # the new answer replaced the damaged row
    assert (code, run.sent) == (0, 0), err


# -- fixed lines and their line-N records -------------------------------------------------------


def test_a_fixed_line_with_an_id_of_its_own_removes_its_line_n_error_record(run: Run) -> None:
    code, _ = run.lines([good("a"), '{"prompt": "no closing brace"', good("c")])()
    assert code == 1
    assert by_id(run.output)["line-2"]["status"] == "invalid"

    code, err = run.lines([good("a"), good("b"), good("c")])()
    assert code == 0, err
    assert set(by_id(run.output)) == set(IDS), "line-2's record went"
    assert "removed 1 error record(s) of lines that have another id now (line-2)" in err


def test_a_line_without_an_id_is_keyed_by_its_line_number(run: Run) -> None:
    code, err = run.lines([{"prompt": "no id here", "max_tokens": 8}])()
    assert code == 0, err
    assert set(by_id(run.output)) == {"line-1"}


# -- prices ------------------------------------------------------------------------------------


def test_a_model_with_no_price_says_so_once_and_its_cost_is_unknown(
    tmp_path: Path, provider: SimulatedProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    run = Run(tmp_path, provider, capsys, priced=False)
    code, err = run.lines([good(i) for i in IDS])()
    assert code == 0, err
    assert err.count("model 'm' has no price") == 1
    assert "its cost is unknown" in err
    assert [r["cost_usd"] for r in records(run.output)] == [None, None, None]
    assert "unknown" in err.split("per model", 1)[1], "the table's cost column"


def test_a_priced_model_says_nothing_of_prices(finished: Run) -> None:
    assert all(r["cost_usd"] not in (None, "0") for r in records(finished.output))


# -- stdin and stdout --------------------------------------------------------------------------


def cli_io(*args: Any, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-m", "callboard", *map(str, args)],
        input=stdin,
        capture_output=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def test_dash_reads_stdin_and_writes_stdout_and_creates_no_file_named_dash(
    tmp_path: Path,
) -> None:
    proc = cli_io("run", "-", "-o", "-", stdin=jsonl(*(good(i) for i in IDS)))
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    assert sorted(r["id"] for r in out) == IDS
    assert all(r["status"] == "completed" for r in out)
    assert "nothing to resume from" in err
    assert "-> stdout" in err
    assert not (Path.cwd() / "-").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_record_that_cannot_be_made_stops_the_run_and_a_rerun_loses_nothing(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug on the thread that writes results killed it, and the run went on sending
    lines whose results nobody wrote (found by a hunt). A record that cannot be made
    now stops the run as a full disk does, saying why; the ledger's results are written
    by the next run, each id once."""
    ids = [f"w{i}" for i in range(30)]
    calls = 0
    make = _run_batch.result_record

    def make_then_fail(*args: Any, **kwargs: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("a bug in a result's record")
        return make(*args, **kwargs)

    monkeypatch.setattr(_run_batch, "result_record", make_then_fail)
    code, err = run.lines([good(i) for i in ids])("--window", "2")
    assert code == 1
    assert "callboard's writer failed" in err
    assert run.sent < len(ids), "it stopped taking lines"
    unwritten = run.sent - len(records(run.output))
    assert f"{unwritten} result(s) could not be written" in err, "the one, and those after it"
    monkeypatch.undo()
    code, err = run()
    assert code == 0, err
    assert Counter(r["id"] for r in records(run.output)) == Counter(ids)


def test_an_output_whose_write_raises_no_oserror_stops_the_run_and_loses_nothing(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed stdout was ``None``: its write raised AttributeError, which the writer
    did not catch (only OSError); it died, every line was still sent and paid for,
    and the summary said "0 results (nothing to do)" (found by a hunt). Whatever the
    write raises stops the run as a full disk does; the ledger keeps what was answered,
    and the next run writes it without sending it again."""
    ids = [f"w{i}" for i in range(30)]

    @contextlib.contextmanager
    def no_stream(_path: Path) -> Iterator[None]:
        yield None  # what open_output gave for ``-o -`` with stdout closed

    monkeypatch.setattr(cli, "open_output", no_stream)
    code, err = run.lines([good(i) for i in ids])(
        "-o", "-", "--ledger", str(run.ledger), "--window", "2"
    )
    assert code == 1, err
    assert "stopped: cannot write stdout (callboard's writer failed" in err
    assert "nothing to do" not in err
    assert 0 < run.sent < len(ids), "it stopped taking lines"
    monkeypatch.undo()
    code, err = run()
    assert code == 0, err
    assert Counter(r["id"] for r in records(run.output)) == Counter(ids)
    assert "of them from the ledger, not sent" in err, "what was answered is not paid again"


def test_a_progress_line_that_fails_is_shown_no_more_and_the_run_goes_on(
    run: Run, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The progress line raised on the writer's thread, which died (found by a hunt)."""
    ids = [f"p{i}" for i in range(10)]

    def fail(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("a bug in the progress line")

    monkeypatch.setattr(_progress.RunProgress, "add", fail)
    code, err = run.lines([good(i) for i in ids])()
    assert code == 0, err
    assert Counter(r["id"] for r in records(run.output)) == Counter(ids)
    assert [r.message for r in caplog.records if r.levelno >= logging.ERROR] == [
        "the run's progress failed (a bug); it is shown no more"
    ]


def test_a_ledger_whose_writes_fail_is_said_in_the_summary(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every commit failing (a damaged page, a full disk that stays full): the results
    reach the output, and the summary says the run was not crash-safe (it ended 0 and
    said nothing of it; found by a hunt)."""
    damaged_commits(monkeypatch)
    code, err = run.lines([good(i) for i in IDS])()
    assert code == 0, err
    assert sorted(r["id"] for r in records(run.output)) == IDS
    assert f"not be written to the ledger {run.ledger}" in err
    assert "not crash-safe" in err


def test_an_output_that_cannot_be_rewritten_with_one_line_per_id_ends_the_run_1(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result that replaces an earlier one is appended, and the file rewritten at the
    end; on a full disk the rewrite failed, and the run ended 0 with two lines for an
    id in its output (found by a hunt). The next run rewrites it."""
    code, err = run.lines([good(i) for i in IDS])()
    assert code == 0, err
    changed = [good(i, "ask again") if i == "b" else good(i) for i in IDS]

    def full_disk(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "compact_output", full_disk)
    code, err = run.lines(changed)("--resend-changed")
    assert code == 1, err
    assert "could not rewrite" in err
    assert Counter(r["id"] for r in records(run.output))["b"] == 2
    monkeypatch.undo()
    code, err = run()
    assert (code, run.sent) == (0, 0), err
    assert Counter(r["id"] for r in records(run.output)) == Counter(IDS)


@pytest.mark.parametrize("where", ["a pipe nobody reads", "a full disk"])
def test_a_stderr_whose_reader_left_stops_nothing(tmp_path: Path, where: str) -> None:
    """``callboard run ... 2>&1 | head``: stderr refuses every write from the first. A
    bad line's error on stderr stopped the run after a line or two, and the progress
    line killed the thread writing results, so the rest were sent and never written
    (found by a hunt). Every line gets its result line; the exit status is the run's."""
    lines: list[Any] = [good(f"ok-{i}") for i in range(40)]
    lines[3:3] = ["not json", {"id": "no prompt"}]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    if where == "a full disk":
        write = os.open("/dev/full", os.O_WRONLY)  # ENOSPC for every write
    else:
        read, write = os.pipe()
        os.close(read)  # nobody reads stderr
    try:
        proc = subprocess.run(  # noqa: S603 - our own module, fixed arguments
            [sys.executable, "-m", "callboard", "run", str(src), "-o", str(out), "--no-ledger"],
            stdout=subprocess.DEVNULL,
            stderr=write,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )
    finally:
        os.close(write)
    assert proc.returncode == 1, "some lines were invalid"
    by_id = Counter(r["id"] for r in records(out))
    assert by_id == Counter([f"ok-{i}" for i in range(40)] + ["line-4", "no prompt"])
    statuses = Counter(r["status"] for r in records(out))
    assert statuses == {"completed": 40, "invalid": 2}


def test_stdin_is_spooled_into_a_file_with_no_name(tmp_path: Path) -> None:
    """The copy of stdin the run reads had a name in a temporary directory: a run
    killed (SIGKILL) left every prompt of its input there for good (found by a hunt)."""
    gate = Gate()
    spool = tmp_path / "tmp"
    spool.mkdir()
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in IDS])
    with WireServer(gate.handler) as srv, src.open("rb") as stdin:
        conf = config(tmp_path / "c.toml", srv.base_url)
        proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            [sys.executable, "-m", "callboard", "run", "-", "-o", "-", "--config", str(conf)],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "TMPDIR": str(spool)},
        )
        try:
            assert wait_until(lambda: srv.count() >= 1)
            named = [p.name for d in spool.iterdir() for p in d.iterdir()]
            gate.release(len(IDS))
            out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
        finally:
            gate.release(len(IDS))
            if proc.poll() is None:
                proc.kill()
                proc.wait(CLI_TIMEOUT_S)
    assert proc.returncode == 0, err.decode()
    assert named == [], "the spooled input has a name"
    assert sorted(json.loads(x)["id"] for x in out.splitlines()) == IDS
    assert list(spool.iterdir()) == []


def test_dev_stdout_into_a_pipe_is_written_not_read(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in IDS])
    proc = cli_io("run", src, "-o", "/dev/stdout")  # used to hang reading the pipe
    assert proc.returncode == 0, proc.stderr.decode()
    assert sorted(json.loads(x)["id"] for x in proc.stdout.splitlines()) == IDS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"], "no lock, no ledger"


def test_stdout_with_a_ledger_writes_its_results_again_without_sending(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in IDS])
    conf = config(tmp_path / "c.toml", provider.base_url)
    args = ["run", src, "-o", "-", "--config", conf, "--ledger", tmp_path / "l.db"]
    first = cli_io(*args)
    assert first.returncode == 0, first.stderr.decode()
    seen = requests_seen(provider)
    again = cli_io(*args)
    assert again.returncode == 0, again.stderr.decode()
    assert requests_seen(provider) == seen, "the ledger's results were sent again"
    assert sorted(json.loads(x)["id"] for x in again.stdout.splitlines()) == IDS


@pytest.mark.parametrize("window", [5, 1000])
def test_a_reader_that_goes_away_stops_the_run_without_a_traceback(
    tmp_path: Path, provider: SimulatedProvider, window: int
) -> None:
    """With a window wider than the input every line was queued before the first write
    failed, and the run drained them all: 2,000 calls paid for after ``head -1`` went
    away (found by a hunt). Once the output fails, what is queued is not sent.

    Calls of a second: by the time the first line is read and the pipe closed, the
    run has sent the first wave and the refills of its freed slots (64 + 64 and the
    16 granted ahead at most), not more, however slow this process is to close
    (at 50 ms a call, a loaded machine let the run write three more waves into the
    pipe before it closed: 200 seen)."""
    provider.configure("m", ModelBehaviour(latency_s=1.0))
    src = write_lines(tmp_path / "in.jsonl", [good(f"q{i}") for i in range(400)])
    conf = config(tmp_path / "c.toml", provider.base_url)
    argv = [sys.executable, "-m", "callboard", "run", src, "-o", "-", "--config", conf]
    with subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
        [*argv, "--window", str(window)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        assert json.loads(proc.stdout.readline())["status"] == "completed"
        proc.stdout.close()  # `| head -1`
        code = proc.wait(CLI_TIMEOUT_S)
        err = proc.stderr.read().decode()
    assert code == 1, err
    assert "Traceback" not in err
    assert "BrokenPipeError" not in err
    assert "callboard: stopped: cannot write stdout (Broken pipe)" in err
    # what was in flight when the write failed ends; nothing queued is sent (all 400 were)
    assert requests_seen(provider) < (100 if window == 5 else 200), "the run stopped sending"


def test_a_run_whose_first_write_fails_does_not_say_it_had_nothing_to_do(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    """It said "0 results (nothing to do)", then that 2 results could not be written
    (found by a hunt)."""
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in IDS])
    conf = config(tmp_path / "c.toml", provider.base_url)
    proc = cli_io("run", src, "-o", "/dev/full", "--config", conf)
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "nothing to do" not in err
    assert "0 results" in err
    assert "none written" in err
    assert "cannot write /dev/full (No space left on device)" in err


def _slow_run_to_stdout(tmp_path: Path, provider: SimulatedProvider) -> list[str]:
    """``callboard run``'s arguments for 400 lines of 50 ms calls, 5 at a time, to stdout."""
    provider.configure("m", ModelBehaviour(latency_s=0.05))
    src = write_lines(tmp_path / "in.jsonl", [good(f"q{i}") for i in range(400)])
    conf = config(tmp_path / "c.toml", provider.base_url)
    return ["run", str(src), "-o", "-", "--config", str(conf), "--window", "5"]


def test_an_interrupted_run_to_stdout_does_not_promise_a_resume(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    argv = _slow_run_to_stdout(tmp_path, provider)
    with subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-c", INTERRUPTIBLE, *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # the first line read a byte at a time: a buffered readline read on into
        # the next line, which ``communicate`` (reading the pipe itself) then began mid-way
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        assert json.loads(proc.stdout.readline())["status"] == "completed"
        proc.send_signal(signal.SIGINT)
        out, err_bytes = proc.communicate(timeout=CLI_TIMEOUT_S)
    err = err_bytes.decode()
    assert proc.returncode == 130, err
    assert "a rerun sends every line again" in err
    assert "run the same command again to resume" not in err
    assert all(json.loads(x)["status"] == "completed" for x in out.splitlines())


AS_CALLBOARD = """
rb.BatchRun._submit = _submit
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv[0] = "callboard"
runpy.run_module("callboard", run_name="__main__")
"""
"""A script's end: ``callboard`` run with its ``_submit`` (a function it defines) as the
batch's, and Python's own SIGINT handler."""


SIGINT_AT_THE_FIRST_SEND = (
    """
import runpy, signal, sys
import callboard._run_batch as rb

def _submit(self, *args, **kwargs):  # a Ctrl-C before anything is sent
    signal.raise_signal(signal.SIGINT)

"""
    + AS_CALLBOARD
)


def test_a_run_interrupted_before_any_result_says_so_not_nothing_to_do(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    """A resumed run stopped before it sent its first new line said "0 results (nothing
    to do)", then "interrupted; run the same command again to resume" (found by a
    hunt)."""
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in IDS])
    conf = config(tmp_path / "c.toml", provider.base_url)
    argv = ["run", src, "-o", tmp_path / "out.jsonl", "--config", conf]
    assert cli_io(*argv).returncode == 0
    write_lines(src, [good(i) for i in ["a", "new", "b", "c"]])  # "b" sees the Ctrl-C
    again = subprocess.run(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-c", SIGINT_AT_THE_FIRST_SEND, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    assert again.returncode == 130, again.stderr
    assert "0 results" in again.stderr
    assert "(interrupted before any was written)" in again.stderr
    assert "nothing to do" not in again.stderr
    assert "1 already done, skipped" in again.stderr


SIGINT_AT_THE_WINDOW = (
    """
import _thread, runpy, signal, sys, threading, time
import callboard._run_batch as rb

def main_waits_for_the_lock():
    frame = sys._current_frames().get(threading.main_thread().ident)
    return frame is not None and frame.f_code.co_name == "__enter__"

def hold(cond, holding):
    with cond:  # until the main thread waits for it, then a SIGINT, then let go
        holding.set()
        for _ in range(2000):
            if main_waits_for_the_lock():
                break
            time.sleep(0.001)
        print("forced:", main_waits_for_the_lock(), file=sys.stderr)
        _thread.interrupt_main()  # pending when it gets the lock (as a SIGINT that lands
                                  # while it waits for the interpreter lock after it)

submit, lines = rb.BatchRun._submit, []

def _submit(self, line, digest, **kw):
    lines.append(line)
    if len(lines) == 8:  # past the window: results are coming back
        holding = threading.Event()
        threading.Thread(target=hold, args=(self.window._cond, holding)).start()
        holding.wait()
    submit(self, line, digest, **kw)

"""
    + AS_CALLBOARD
)


def test_a_ctrl_c_that_lands_inside_the_windows_lock_still_stops_the_run(
    tmp_path: Path, provider: SimulatedProvider
) -> None:
    """A Ctrl-C that landed while the main thread had just taken the window's lock
    (``Condition.__enter__`` is Python: the signal is handled before the ``with``
    holds it) left that lock taken for good: each result's release of the window
    waited for ever, and so did the stop (1 run in about 1,500 in CI). The handler now
    only notes the signal; the run stops at a point where it holds no lock."""
    argv = _slow_run_to_stdout(tmp_path, provider)
    with subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
        [sys.executable, "-c", SIGINT_AT_THE_WINDOW, *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        try:
            _, err_bytes = proc.communicate(timeout=CLI_TIMEOUT_S / 3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail("the run never stopped after the Ctrl-C")
    err = err_bytes.decode()
    assert "forced: True" in err  # the signal came while the lock was taken
    assert proc.returncode == 130, err
    assert "did not stop within" not in err


# -- a provider that is down, or refuses the key -----------------------------------------


def _ended_provider_down(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    base_url: str,
    breaker: str,
    ids: tuple[str, ...],
) -> list[dict[str, Any]]:
    """``callboard run`` of ``ids`` against ``base_url`` (``give_up_s = 1``, ``breaker``)
    ends by itself, promptly, every line failed and some provider_down, saying how to
    retry: its records."""
    conf = tmp_path / "c.toml"
    conf.write_text(
        f'give_up_s = 1\n[models.m]\nbase_url = "{base_url}"\nbreaker = {breaker}\n'
        "retry = { initial_s = 0.01, jitter_s = 0 }\n",
        encoding="utf-8",
    )
    src = write_lines(tmp_path / "in.jsonl", [good(i) for i in ids])
    out = tmp_path / "out.jsonl"
    started = time.monotonic()
    code = main(["run", str(src), "-o", str(out), "--config", str(conf)])
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == 1
    assert took < 30, took
    got = records(out)
    assert sorted(r["id"] for r in got) == sorted(ids)
    assert all(r["status"] == "failed" for r in got), got
    assert Counter(r["error"]["reason"] for r in got)["provider_down"] >= 1, got
    assert "--retry-failed" in err
    return got


def test_a_run_against_a_dead_endpoint_ends_by_itself_saying_why_and_how_to_retry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 14: against an unreachable base_url the run never ended. Given up on after
    give_up_s, every line ends provider_down naming the refused connection."""
    port = dead_port()
    breaker = "{ consecutive_failures = 2, cooldown_s = 0.2 }"
    got = _ended_provider_down(
        tmp_path, capsys, f"http://127.0.0.1:{port}/v1", breaker, ("a", "b", "c", "d", "e")
    )
    reasons = Counter(r["error"]["reason"] for r in got)
    assert set(reasons) <= {"provider_down", "connection"}, reasons
    assert all("refused" in r["error"]["detail"].lower() for r in got), got


def test_a_run_against_a_provider_that_answers_429_to_everything_ends_by_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 429 is no outage, so a provider refusing every call with one never opened the
    breaker: a run of two lines was still going after 8 minutes, the limiter down to
    its floor of a call a minute (found by a hunt). After give_up_s of nothing but
    429s the model is down, and after give_up_s more its lines end provider_down."""
    refusal = {"error": {"message": "Rate limit reached", "type": "requests"}}
    with WireServer(answer(refusal, status=429, headers={"retry-after": "0.05"})) as srv:
        got = _ended_provider_down(
            tmp_path, capsys, srv.base_url, "{ cooldown_s = 0.2 }", ("a", "b", "c")
        )
    assert all("429" in r["error"]["detail"] for r in got), got


def test_after_a_key_fix_retry_failed_completes_against_a_provider_that_is_not_ours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 14, point 6, against a loopback server built from OpenAI's documentation
    (not the simulator): a wrong key fails every line AUTHENTICATION with OpenAI's own
    words; once the key is fixed, ``--retry-failed`` sends exactly those lines again."""
    from aiohttp import web
    from loopback import USAGE, WireServer, completion_body

    good_key = "sk-cb-right-0123456789"
    bad_body = {
        "error": {
            "message": "Incorrect API key provided: sk-cb-wr****6789.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }

    async def handler(request: web.Request, arrival: Any) -> web.StreamResponse:
        if arrival.headers.get("authorization") != f"Bearer {good_key}":
            return web.json_response(bad_body, status=401)
        return web.json_response(completion_body(usage=USAGE))

    with WireServer(handler) as server:
        conf = tmp_path / "c.toml"
        conf.write_text(
            f'[models.m]\nbase_url = "{server.base_url}"\napi_key_env = "CB_TEST_KEY"\n'
            'price = { input = "1.00", output = "2.00" }\n',
            encoding="utf-8",
        )
        src = write_lines(tmp_path / "in.jsonl", [good(i) for i in IDS])
        out = tmp_path / "out.jsonl"
        argv = ["run", str(src), "-o", str(out), "--config", str(conf)]
        with pytest.MonkeyPatch.context() as env:
            env.setenv("CB_TEST_KEY", "sk-cb-wrong-0123456789")
            assert main(argv) == 1
            err = capsys.readouterr().err
            first = {r["id"]: r for r in records(out)}
            assert {r["error"]["reason"] for r in first.values()} == {"authentication"}
            assert "Incorrect API key provided" in first["a"]["error"]["detail"]
            assert "--retry-failed" in err
            assert "sk-cb-wrong-0123456789" not in err + out.read_text()
            sent_before = server.count()
            env.setenv("CB_TEST_KEY", good_key)
            assert main([*argv, "--retry-failed"]) == 0, capsys.readouterr().err
        assert server.count() - sent_before == len(IDS)
        final = {r["id"]: r["status"] for r in records(out)}
        assert final == dict.fromkeys(IDS, "completed")
        assert len(out.read_text().splitlines()) == len(IDS)  # one line per id
