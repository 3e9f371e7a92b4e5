"""``callboard bench``: how fast and how correct callboard is, measured against baselines.

Usage: ``python -m callboard.bench [--quick] [--out DIR] [--scenarios a,b] [--baselines x,y]``.

Each scenario (steady, rate-limited, misconfigured-limit, faulty, outage,
dead-provider, priority, backlog, crash, streaming, embeddings, tenants, gateway,
cluster: see each one's module; ``redaction`` measures the redactor in process, no
provider) starts the provider in its own process on 127.0.0.1, so
the client's figures hold only the client's work, runs callboard and the
selected baselines (aiohttp, httpx-aiohttp, httpx, serial, litellm: see
``clients``) on the same workload, and stops the provider. On a shared 2-core
machine absolute figures drift, so every figure that matters is a ratio to a
baseline measured in the same run (steady: in the same round). Every system
runs with the GIL switch interval of ``callboard run``: the single-threaded
baselines do not feel it; callboard's hops between threads do. The outputs
are a table on the terminal and, under ``--out``, ``bench.json`` (every figure
and the environment), ``bench.md`` and ``bench.png`` (with matplotlib).

What must hold: all load goes to 127.0.0.1 and is bounded in count and time;
every provider process and every callboard system started here is stopped
(try/finally; SIGTERM raises SystemExit so those run, and a provider child
also exits when its stdin closes, should this process die outright) and no
thread is left behind; a scenario that fails is reported as an error and the
others still run. Targets are printed as PASS/MISS and never change the exit
status: 0 when every scenario ran, 1 when one failed, 2 for a usage error
(arguments and ``--out`` are checked before any scenario runs), 143 on SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from callboard.bench.backlog import run_backlog
from callboard.bench.clients import BASELINES, litellm_available
from callboard.bench.cluster import run_cluster
from callboard.bench.crash import run_crash
from callboard.bench.dead import run_dead_provider
from callboard.bench.embeddings import run_embeddings
from callboard.bench.faults import run_faulty, run_misconfigured_limit, run_rate_limited
from callboard.bench.gateway import run_gateway
from callboard.bench.measure import ScenarioResult
from callboard.bench.outage import run_outage
from callboard.bench.plan import SCENARIOS, Options, Scale
from callboard.bench.priority import run_priority
from callboard.bench.redaction import run_redaction
from callboard.bench.report import Report, prepare_out, render_table, write_outputs
from callboard.bench.steady import run_steady
from callboard.bench.streaming import run_streaming
from callboard.bench.targets import evaluate
from callboard.bench.tenants import run_tenants
from callboard.runtime.collector import steady_heap
from callboard.runtime.switch_interval import SwitchInterval

from callboard._signals import handling
from callboard.config import RUN_SWITCH_INTERVAL_S

__all__ = ["main"]

log = logging.getLogger(__name__)

RUNNERS: dict[str, Callable[[Options], ScenarioResult]] = {
    "steady": run_steady,
    "rate-limited": run_rate_limited,
    "misconfigured-limit": run_misconfigured_limit,
    "faulty": run_faulty,
    "outage": run_outage,
    "dead-provider": run_dead_provider,
    "priority": run_priority,
    "backlog": run_backlog,
    "crash": run_crash,
    "streaming": run_streaming,
    "embeddings": run_embeddings,
    "tenants": run_tenants,
    "gateway": run_gateway,
    "cluster": run_cluster,
    "redaction": run_redaction,
}
PROVIDERS = ("sim", "asgi")
ASGI_SCENARIOS = ("steady",)
"""What the ASGI provider can serve: plain completions at a fixed latency."""
PACKAGES = (
    "callboard",
    "pykka",
    "httpx",
    "httpx-aiohttp",
    "aiohttp",
    "uvloop",
    "tenacity",
    "uvicorn",
)
OPTIONAL = ("matplotlib", "litellm")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; ``argv`` as on the command line (without the program name)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("callboard.bench").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        opts = _options(args)
        out = prepare_out(Path(args.out))  # before minutes of load, not after
    except ValueError as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    # as ``callboard run`` does: every system here (baselines too) runs with its switch
    switch = SwitchInterval(RUN_SWITCH_INTERVAL_S)  # interval and its steady collector
    switch.hold()
    env = environment()
    try:
        with handling(_exit_on_sigterm, signal.SIGTERM), steady_heap():
            results, errors = run_scenarios(opts)
    finally:
        switch.release()
    env["loadavg_end"] = _loadavg()
    env["cpu_pressure_end"] = _cpu_pressure()
    report = Report(
        environment=env,
        options=opts.as_json(),
        results=results,
        targets=evaluate(results, list(opts.baselines)),
        baselines=list(opts.baselines),
        errors=errors,
        notes=list(opts.notes),
        seconds=time.perf_counter() - started,
    )
    print(render_table(report))  # first: a report that cannot be written loses nothing shown
    noted = len(report.notes)
    try:
        paths = write_outputs(report, out)
    except (OSError, ValueError) as exc:  # a full disk after a 17-minute run, the directory
        # gone meanwhile: a traceback, and no table (found by a hunt)
        print(f"callboard bench: cannot write the report to {out}: {exc}", file=sys.stderr)
        return 1
    for note in report.notes[noted:]:  # what writing it found (a plot it could not draw)
        print(f"note: {note}")
    print("\nwritten: " + ", ".join(str(p) for p in paths.values()))
    return 1 if errors else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="callboard bench",
        description="How fast and how correct callboard is, measured against baselines.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 every scenario ran (targets never change it), "
        "1 a scenario failed, 2 usage error, 143 SIGTERM",
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="every scenario small (a minute or two)")
    add("--out", default="bench-report", help="output directory (default: bench-report/)")
    add("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {','.join(SCENARIOS)}")
    add(
        "--baselines",
        default="all",
        help=f"comma-separated: {','.join(BASELINES)}; 'all' (default) or 'none'",
    )
    add("--seed", type=int, default=7, help="seed of the provider and the workloads")
    add(
        "--provider",
        choices=PROVIDERS,
        default="sim",
        help="the server to load: sim (ours, default) or asgi (a bare ASGI app on uvicorn "
        "with uvloop and httptools; steady only; needs callboard[bench])",
    )
    add("-q", "--quiet", action="store_true", help="no progress log")
    return parser


def _options(args: argparse.Namespace) -> Options:
    scenarios = _names(args.scenarios, SCENARIOS, "scenario")
    notes: list[str] = []
    if args.baselines == "all":
        baselines = tuple(b for b in BASELINES if b != "litellm" or litellm_available())
        if not litellm_available():
            notes.append("LiteLLM baseline skipped: litellm is not importable")
    elif args.baselines == "none":
        baselines = ()
    else:
        baselines = _names(args.baselines, BASELINES, "baseline")
        if "litellm" in baselines and not litellm_available():
            raise ValueError(
                "baseline 'litellm' was requested but litellm is not importable "
                "(pip install litellm, or leave it out)"
            )
    if args.provider == "asgi":
        others = [s for s in scenarios if s not in ASGI_SCENARIOS]
        if others:
            raise ValueError(
                f"--provider asgi runs only {', '.join(ASGI_SCENARIOS)}: it cannot play "
                f"{', '.join(others)} (faults and limits are the simulated provider's)"
            )
        if importlib.util.find_spec("uvicorn") is None:
            raise ValueError("--provider asgi needs uvicorn: pip install 'callboard[bench]'")
    scale = Scale.small() if args.quick else Scale.full()
    return Options(
        scale=scale,
        scenarios=scenarios,
        baselines=baselines,
        seed=args.seed,
        provider=args.provider,
        notes=notes,
    )


def _names(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    # a name given twice runs once: twice would skew its rounds and ratios
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    choose = f"choose from {', '.join(known)}"
    if not names:  # "--scenarios ," said "unknown scenario(s) []"
        raise ValueError(f"no {what} named in {text!r}; {choose}")
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(map(repr, unknown))}; {choose}")
    return names


def _exit_on_sigterm(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM (a timeout, a CI cancel) raises SystemExit, so every finally runs.

    Without it the process dies at once and its provider child is left behind
    (the child also exits when its stdin closes; this stops it in order). Only
    the main thread can install a handler; elsewhere ``handling`` does nothing.
    """
    raise SystemExit(128 + signum)


def run_scenarios(opts: Options) -> tuple[dict[str, ScenarioResult], dict[str, str]]:
    """Run the selected scenarios in order; a failing one is recorded and skipped."""
    results: dict[str, ScenarioResult] = {}
    errors: dict[str, str] = {}
    for name in opts.scenarios:
        log.info("scenario %s: starting", name)
        started = time.perf_counter()
        try:
            result = RUNNERS[name](opts)
        except Exception as exc:  # report it and go on with the other scenarios
            log.exception("scenario %s failed", name)
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        result.seconds = time.perf_counter() - started
        log.info("scenario %s: done in %.1f s", name, result.seconds)
        results[name] = result
    return results, errors


def environment() -> dict[str, Any]:
    """Python, packages, cores and load: what the figures depend on."""
    versions: dict[str, str | None] = {}
    for name in (*PACKAGES, *OPTIONAL):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "loadavg_start": _loadavg(),
        "cpu_pressure_start": _cpu_pressure(),
        "event_loop": "uvloop" if versions.get("uvloop") else "asyncio",
        "switch_interval_s": sys.getswitchinterval(),
        "packages": versions,
    }


def _cpu_pressure() -> dict[str, float] | None:
    """The share of time some runnable task waited for a CPU, over the last 10, 60 and
    300 s (Linux's pressure stall information; None elsewhere): on a shared machine,
    how much of a latency figure may be other work's."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    return {k: float(v) for k, v in fields.items() if k.startswith("avg")}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
