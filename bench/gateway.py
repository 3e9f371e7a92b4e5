"""Scenario ``gateway``: what ``callboard serve`` adds between a client and its provider.

Four processes besides this one: the simulated provider (every call 50 ms, as
``steady``), ``callboard serve`` in front of it (one model, ``max_concurrency``
the highest level, open on loopback), a bare reverse proxy in front of it too
(``bench/bare_proxy.py``: one aiohttp server, one aiohttp client, nothing else:
what one more HTTP hop costs any gateway on this machine), and a load generator:
the raw aiohttp client of the ``aiohttp`` baseline (one shared session, a
semaphore of C), in a process of its own so that it shares no interpreter lock
with the gateway or with this bench (one generator for the whole scenario, one
run per line on its stdin). At each level C (10, 50 and 200: at 10 the gateway
is not CPU-bound, so the figures show what it adds to a call) the generator
sends the same requests through the gateway (``gateway``), through the bare
proxy (``proxy``) and straight to the provider (``aiohttp``), in rounds of
alternating order. Each run opens its connections first (C requests, half then
all, not measured).

Figures per level, each a median over rounds of same-round figures: the
gateway's throughput over the direct one; its added latency at p50 and p99
(the generator's percentile through the gateway less the direct one's); the
same three for the bare proxy (``proxy``: the floor, what the hop alone costs);
the gateway over the bare proxy (``over_proxy``: what callboard's own work
costs, the hop aside); and the gateway process's CPU per request (``/proc``:
every thread of it, the system's actors and I/O loop with the HTTP server; and
its main thread alone, the server's loop) over the measured part.
LiteLLM's proxy runs beside them (``litellm``, one worker, in front of the same
provider) when there is a ``litellm`` program to run (``bench/litellm_proxy.py``);
it is not a dependency, and the report says when it was not run. Its figures:
over the direct runs, as the bare proxy's, and the gateway over it
(``over_litellm``).

The parent and the generator meet on the generator's stdin and stdout: for
each run it reads the order as a JSON line, says ``measuring`` when its warm-up
is done and waits for ``go`` (the provider's counters are reset and the
gateway's CPU read meanwhile), then prints its ``Run`` as one JSON line.

What must hold: every child (provider, gateway, generator) is stopped and its
pipes closed, whatever happens; should this process die outright, each child
sees its stdin close and exits; a run is bounded by its time cap.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Self

from callboard.bench import bare_proxy, litellm_proxy
from callboard.bench.clients import Workload, run_baseline
from callboard.bench.measure import Percentiles, Run, ScenarioResult, median
from callboard.bench.plan import Options
from callboard.bench.provider_process import ProviderProcess, stop_child

__all__ = [
    "GatewayProcess",
    "LiteLLMProcess",
    "LoadProcess",
    "ProxyProcess",
    "gateway_figures",
    "run_from_json",
    "run_gateway",
]

log = logging.getLogger(__name__)

NAME = "gateway"
MODEL = "steady"
COMPLETION_TOKENS = 24
SYSTEMS = ("gateway", "proxy", "aiohttp")
"""Through the gateway, through the bare proxy, and straight to the provider."""
LITELLM = "litellm"
"""Through LiteLLM's proxy, when there is one to run (``bench/litellm_proxy.py``)."""
_START_TIMEOUT_S = 60.0
_READY = "measuring"
_GO = "go"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_CPU_FIGURES = ("gateway_cpu_ms_per_request", "gateway_loop_cpu_ms_per_request")
"""The gateway process's CPU per request: every thread; its busiest thread alone (the
I/O loop: aiohttp's server, the handlers, building and submitting each request, and
every call to the provider; the rest is callboard's actors)."""


def run_gateway(opts: Options) -> ScenarioResult:
    scale = opts.scale
    result = ScenarioResult(name=NAME)
    result.settings = {
        "latency_s": scale.latency_s,
        "levels": list(scale.gateway_levels),
        "tasks": scale.gateway_tasks,
        "rounds": scale.gateway_rounds,
        "completion_tokens": COMPLETION_TOKENS,
        "gateway_max_concurrency": max(scale.gateway_levels),
    }
    extra = ["--completion-tokens", str(COMPLETION_TOKENS)]
    litellm = litellm_proxy.program()
    systems = (*SYSTEMS, LITELLM) if litellm is not None else SYSTEMS
    with contextlib.ExitStack() as stack:
        gen = stack.enter_context(LoadProcess())  # first: it starts while the rest do
        prov = stack.enter_context(
            ProviderProcess(latency_s=scale.latency_s, seed=opts.seed, extra_args=extra)
        )
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="callboard-bench-gateway-"))
        config = _config(Path(tmp), prov.base_url, max(scale.gateway_levels))
        gw = stack.enter_context(GatewayProcess(config))
        urls = {
            "gateway": gw.base_url,
            "proxy": stack.enter_context(ProxyProcess(prov.base_url)).base_url,
            "aiohttp": prov.base_url,
        }
        if litellm is not None:
            urls[LITELLM] = stack.enter_context(LiteLLMProcess(prov.base_url)).base_url
        for level in scale.gateway_levels:
            for rnd in range(scale.gateway_rounds):
                order = systems if rnd % 2 == 0 else systems[::-1]
                for system in order:
                    log.info("gateway C%d round %d: %s", level, rnd, system)
                    work = Workload(
                        base_url=urls[system],
                        model=MODEL,
                        tasks=scale.gateway_tasks,
                        concurrency=level,
                        warmup=level,
                        # LiteLLM's proxy serves some 100 a second here: under a cap, as
                        # steady's slow baselines, or it alone would take minutes a level
                        time_cap_s=scale.slow_cap_s if system == LITELLM else 120.0,
                    )
                    run = _measured(prov, gw, gen, system, work)
                    run.round = rnd
                    result.runs.append(run)
    result.figures = gateway_figures(result.runs)
    if litellm is None:
        result.notes.append(
            "LiteLLM's proxy not run beside it: no litellm program "
            f"(pip install 'litellm[proxy]', or set {litellm_proxy.ENV})"
        )
    else:
        result.settings["litellm"] = {
            "version": litellm_proxy.version(litellm),
            "workers": 1,
        }
    return result


def _config(tmp: Path, provider_url: str, cap: int) -> Path:
    path = tmp / "callboard.toml"
    path.write_text(
        f'[models.{MODEL}]\nbase_url = "{provider_url}"\nmax_concurrency = {cap}\n',
        encoding="utf-8",
    )
    return path


def _measured(
    prov: ProviderProcess, gw: GatewayProcess, gen: LoadProcess, system: str, work: Workload
) -> Run:
    """One generator run; the gateway's CPU over its measured part goes in ``extra``."""
    marks: list[tuple[float | None, dict[int, float]]] = []

    def on_start() -> None:
        prov.reset_stats()
        marks.append((gw.cpu_s(), gw.threads_cpu_s()))

    run = gen.run(system, work, on_start)
    ended, threads = gw.cpu_s(), gw.threads_cpu_s()
    run.take_server(prov.stats())
    if system == "gateway" and marks and run.ok:
        began, before = marks[0]
        total = None if began is None or ended is None else ended - began
        if total is not None:
            run.extra[_CPU_FIGURES[0]] = round(1000.0 * total / run.ok, 4)
        # the busiest thread: the I/O loop, which serves the requests and makes the calls;
        # never more than the whole (each is read in clock ticks, a moment apart: a small
        # run read a tick more for the thread than for the process, in a CI run)
        spent = [cpu - before.get(tid, 0.0) for tid, cpu in threads.items()]
        if spent:
            busiest = max(spent) if total is None else min(max(spent), total)
            run.extra[_CPU_FIGURES[1]] = round(1000.0 * busiest / run.ok, 4)
    return run


# -- figures ---------------------------------------------------------------------------


def gateway_figures(runs: Sequence[Run]) -> dict[str, Any]:
    """Per level: the throughput ratio, the added p50 and p99 and the gateway's CPU per
    request, each the median over rounds of that round's figure; the bare proxy's three
    over the direct run (``proxy``), and the gateway's over the proxy's (``over_proxy``)."""
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r.label for r in runs):
        by = {(r.system, r.round): r for r in runs if r.label == label}
        systems = [s for s in (*SYSTEMS, LITELLM) if any(n == s for n, _ in by)]
        pairs = _pairs(by, "gateway", "aiohttp")
        out[label] = {
            **_against(pairs),
            "proxy": _against(_pairs(by, "proxy", "aiohttp")),
            "over_proxy": _against(_pairs(by, "gateway", "proxy")),
            **_beside_litellm(by),
            **{name: _med(g.extra.get(name) for g, _ in pairs) for name in _CPU_FIGURES},
            "throughput": {
                s: _med(r.throughput for (n, _), r in by.items() if n == s) for s in systems
            },
            "p50_ms": {
                s: _med(r.latency.p50 for (n, _), r in by.items() if n == s) for s in systems
            },
            "p99_ms": {
                s: _med(r.latency.p99 for (n, _), r in by.items() if n == s) for s in systems
            },
            "failed": sum(
                r.failed + (r.extra.get("skipped_at_time_cap") or 0)
                for (n, _), r in by.items()
                if n == "gateway"
            ),
        }
    return out


def _beside_litellm(by: dict[tuple[str, int], Run]) -> dict[str, Any]:
    """LiteLLM's proxy over the direct runs (``litellm``: the peer's own cost), and the
    gateway over LiteLLM's proxy (``over_litellm``); nothing when it did not run."""
    if not any(n == LITELLM for n, _ in by):
        return {}
    return {
        "litellm": _against(_pairs(by, LITELLM, "aiohttp")),
        "over_litellm": _against(_pairs(by, "gateway", LITELLM)),
    }


def _pairs(by: dict[tuple[str, int], Run], system: str, base: str) -> list[tuple[Run, Run]]:
    """``system``'s run and ``base``'s of each round that has both."""
    rounds = sorted({k for _, k in by})
    return [
        (by[(system, k)], by[(base, k)]) for k in rounds if (system, k) in by and (base, k) in by
    ]


def _against(pairs: Sequence[tuple[Run, Run]]) -> dict[str, float | None]:
    """The first run of each pair over the second: throughput ratio, added p50 and p99."""
    return {
        "throughput_ratio": _med(a.throughput / b.throughput for a, b in pairs if b.throughput),
        "added_p50_ms": _med(_diff(a.latency.p50, b.latency.p50) for a, b in pairs),
        "added_p99_ms": _med(_diff(a.latency.p99, b.latency.p99) for a, b in pairs),
    }


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _med(values: Any) -> float | None:
    found = [v for v in values if v is not None]
    value = median(found)
    return None if value is None else round(value, 4)


# -- the children --------------------------------------------------------------------


class _Child:
    """A child process of ours: started with a pipe on stdin (its EOF tells it we are
    gone), stopped with SIGINT then SIGKILL; stderr kept in a temporary file."""

    def __init__(self, argv: list[str]) -> None:
        self._argv = argv
        self.proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def line(self, timeout: float) -> str:
        """The child's next line on stdout ('' if none came within ``timeout``)."""
        proc = self._running()
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if sel.select(left):
                    return proc.stdout.readline()
        return ""

    def send(self, text: str) -> None:
        proc = self._running()
        assert proc.stdin is not None
        proc.stdin.write(text + "\n")
        proc.stdin.flush()

    def _running(self) -> subprocess.Popen[str]:
        if self.proc is None:
            raise RuntimeError("the child process is not running")
        return self.proc

    def stderr(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-2000:].decode("utf-8", "replace")

    def cpu_s(self) -> float | None:
        """The child's CPU seconds so far, every thread's (``/proc``; None without it)."""
        if self.proc is None:
            return None
        return _stat_cpu_s(Path(f"/proc/{self.proc.pid}/stat"))

    def threads_cpu_s(self) -> dict[int, float]:
        """Each live thread's CPU seconds so far, by thread id (empty without ``/proc``)."""
        if self.proc is None:
            return {}
        tasks = Path(f"/proc/{self.proc.pid}/task")
        try:
            ids = [int(entry.name) for entry in tasks.iterdir()]
        except OSError:
            return {}
        used = {tid: _stat_cpu_s(tasks / str(tid) / "stat") for tid in ids}
        return {tid: cpu for tid, cpu in used.items() if cpu is not None}

    def stop(self) -> None:
        """Stop the child and close its pipes and log; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_child(proc)
        if self._log is not None:
            self._log.close()
            self._log = None


class _Server(_Child):
    """A child that serves HTTP: started on entry, its base URL read from the one line
    it announces itself with (``announcement`` then the URL)."""

    announcement = ""
    what = ""
    start_timeout_s = _START_TIMEOUT_S

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.base_url = ""
        self.pid = 0

    def __enter__(self) -> Self:
        self.start()
        try:
            self.base_url = self._base_url(self._announced())
            self.pid = self._running().pid
        except BaseException:
            self.stop()
            raise
        return self

    def _announced(self) -> str:
        line = self.line(self.start_timeout_s)
        if not line.startswith(self.announcement):
            raise RuntimeError(f"{self.what} did not start: {line!r}; {self.stderr()}")
        return line.removeprefix(self.announcement).strip()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _base_url(self, announced: str) -> str:
        return announced


class GatewayProcess(_Server):
    """``callboard serve --config CONFIG --port 0`` (``serve`` itself, run by this
    module's ``serve`` command so that it also stops when its stdin closes)."""

    what = "the gateway"

    def __init__(self, config: Path) -> None:
        from callboard.gateway import ANNOUNCEMENT

        super().__init__([sys.executable, "-m", __name__, "serve", "--config", str(config)])
        self.announcement = ANNOUNCEMENT

    def _base_url(self, announced: str) -> str:
        return announced + "/v1"


class ProxyProcess(_Server):
    """The bare reverse proxy (``bench/bare_proxy.py``) in front of ``upstream``."""

    announcement = bare_proxy.ANNOUNCEMENT
    what = "the bare proxy"

    def __init__(self, upstream: str) -> None:
        super().__init__([sys.executable, "-m", bare_proxy.__name__, "--upstream", upstream])


class LiteLLMProcess(_Server):
    """LiteLLM's proxy in front of ``upstream`` (``bench/litellm_proxy.py``)."""

    announcement = litellm_proxy.ANNOUNCEMENT
    what = "LiteLLM's proxy"
    start_timeout_s = litellm_proxy.START_TIMEOUT_S + 10.0  # it imports a great deal first

    def __init__(self, upstream: str) -> None:
        module = litellm_proxy.__name__
        super().__init__([sys.executable, "-m", module, "--upstream", upstream, "--model", MODEL])


class LoadProcess(_Child):
    """The raw aiohttp generator in a process of its own, for every run of a scenario
    (one interpreter start, not one a run)."""

    def __init__(self) -> None:
        super().__init__([sys.executable, "-m", __name__, "load"])

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, system: str, work: Workload, on_start: Callable[[], object]) -> Run:
        """Measure ``work`` as ``system``; ``on_start`` runs here once the generator's
        warm-up is done, before its measured part."""
        self.send(json.dumps({"system": system, "work": dataclasses.asdict(work)}))
        ready = self.line(_START_TIMEOUT_S + work.time_cap_s)
        if ready.strip() != _READY:
            raise RuntimeError(f"the load generator did not warm up: {ready!r}; {self.stderr()}")
        on_start()
        self.send(_GO)
        answer = self.line(2 * work.time_cap_s)
        if not answer:
            raise RuntimeError(f"the load generator gave no result; {self.stderr()}")
        return run_from_json(json.loads(answer))


def run_from_json(data: dict[str, Any]) -> Run:
    """A ``Run`` from ``Run.as_json``'s output."""
    fields = {f.name for f in dataclasses.fields(Run)}
    kept = {k: v for k, v in data.items() if k in fields}
    kept["latency"] = Percentiles(**kept["latency"])
    kept["end_to_end"] = Percentiles(**kept["end_to_end"])
    kept["queue_wait"] = {k: Percentiles(**v) for k, v in kept["queue_wait"].items()}
    return Run(**kept)


# -- the children's side ---------------------------------------------------------------


def _load() -> int:
    """The generator: for each order on stdin, warm up, say so, wait for the word,
    measure, print the run; until stdin closes."""

    def on_start() -> None:
        sys.stdout.write(_READY + "\n")
        sys.stdout.flush()
        if sys.stdin.readline().strip() != _GO:
            raise SystemExit(1)  # the bench went away

    for line in sys.stdin:
        order = json.loads(line)
        work = Workload(**order["work"])
        run = run_baseline("aiohttp", NAME, f"C{work.concurrency}", work, on_start=on_start)
        run.system = order["system"]
        sys.stdout.write(json.dumps(run.as_json()) + "\n")
        sys.stdout.flush()
    return 0


def _serve(config: str) -> int:
    """``callboard serve --config CONFIG --port 0``, stopped (gracefully) when stdin
    closes as well as by SIGTERM or SIGINT."""
    from callboard.gateway import server

    def watch() -> None:
        sys.stdin.read()  # returns at EOF: the bench is gone or stopping us
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stdin-eof", daemon=True).start()
    return server.main(["--config", config, "--port", "0"])


def _stat_cpu_s(stat: Path) -> float | None:
    """User and system CPU seconds from a ``/proc`` stat file (None: gone, or no ``/proc``)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m callboard.bench.gateway")
    sub = parser.add_subparsers(dest="role", required=True)
    serve = sub.add_parser("serve", help="callboard serve, stopped when stdin closes")
    serve.add_argument("--config", required=True)
    sub.add_parser("load", help="the raw aiohttp generator, one run per line on stdin")
    args = parser.parse_args(argv)
    if args.role == "serve":
        return _serve(args.config)
    return _load()


if __name__ == "__main__":
    sys.exit(main())
