"""Take ``docs/dashboard.png``: the dashboard of a gateway under load.

    python docs/dashboard_screenshot.py [--seconds 90] [-o docs/dashboard.png]

Starts the simulated provider with four models (``fast``; ``smart``, slower, rate
limited and streamed; ``batch``, four calls at a time, so a queue forms; ``flaky``,
whose every call fails, so its breaker opens), a gateway in front of it with two
client keys (tenants ``web`` at high priority and ``eval`` at low), and runs load
through the gateway's OpenAI API for ``--seconds`` while a headless Chromium (the
tests' DevTools driver, ``tests/browser.py``) keeps the page open; then saves what
the browser shows. Needs ``chromium`` (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import random
import sys
from pathlib import Path

import aiohttp
from callboard.gateway import ClientKey, Gateway, GatewayConfig, GatewaySettings
from callboard.messages import Priority
from callboard.provider.server import ModelBehaviour, SimulatedProvider

from callboard import (
    BreakerConfig,
    LimiterConfig,
    ModelSettings,
    Price,
    RetryConfig,
    SystemConfig,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from browser import Chromium, find_chromium  # noqa: E402 - the tests' driver, from tests/

KEYS = {"web": "sk-web-dashboard-demo", "eval": "sk-eval-dashboard-demo"}
UPSTREAM = {
    "fast": ModelBehaviour(latency_s=0.08, jitter_s=0.04),
    "smart": ModelBehaviour(latency_s=0.6, jitter_s=0.3, ttft_s=0.25, token_gap_s=0.01),
    "batch": ModelBehaviour(latency_s=0.6, jitter_s=0.3),
    "flaky": ModelBehaviour(latency_s=0.05, status=500),
}


def config(base_url: str) -> GatewayConfig:
    def price(inp: str, out: str) -> Price:
        from decimal import Decimal

        return Price(input_per_mtok=Decimal(inp), output_per_mtok=Decimal(out))

    models = (
        ModelSettings(
            name="fast", base_url=base_url, price=price("0.15", "0.60"), max_concurrency=32
        ),
        ModelSettings(
            name="smart",
            base_url=base_url,
            price=price("2.50", "10.00"),
            max_concurrency=16,
            limiter=LimiterConfig(rpm=600, tpm=400_000),
        ),
        ModelSettings(
            name="batch", base_url=base_url, price=price("0.10", "0.40"), max_concurrency=4
        ),
        ModelSettings(
            name="flaky",
            base_url=base_url,
            price=price("1.00", "2.00"),
            retry=RetryConfig(max_attempts=1),
            breaker=BreakerConfig(consecutive_failures=3, cooldown_s=120.0),
        ),
    )
    keys = (
        ClientKey(
            name="web",
            digest=hashlib.sha256(KEYS["web"].encode()).digest(),
            tenant="web",
            priority=Priority.HIGH,
        ),
        ClientKey(
            name="eval",
            digest=hashlib.sha256(KEYS["eval"].encode()).digest(),
            tenant="eval",
            priority=Priority.LOW,
        ),
    )
    system = SystemConfig(models=models, default_route=("fast",))
    return GatewayConfig(system=system, gateway=GatewaySettings(keys=keys))


async def client(
    url: str, key: str, plan: list[tuple[str, bool]], start: float, until: float
) -> None:
    """One caller: requests from ``plan`` in turn from ``start`` to ``until`` (loop time)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start - loop.time()))
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for model, stream in itertools.cycle(plan):
            if loop.time() > until:
                return
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Summarise the minutes, please."}],
                "stream": stream,
            }
            async with session.post(f"{url}/v1/chat/completions", json=body) as answer:
                await answer.read()


async def main(seconds: float, out: Path) -> None:
    executable = find_chromium()
    if executable is None:
        raise SystemExit("needs chromium: apt-get install chromium")
    rng = random.Random(16)
    with SimulatedProvider(models=UPSTREAM, default=UPSTREAM["fast"], seed=16) as upstream:
        async with Gateway(config(upstream.base_url), port=0) as gateway:
            with Chromium(executable, width=1440, height=1080) as browser:
                await asyncio.to_thread(browser.navigate, f"{gateway.url}/")
                await asyncio.to_thread(
                    browser.evaluate, f"sessionStorage.setItem('callboard.key', {KEYS['web']!r})"
                )
                await asyncio.to_thread(browser.navigate, f"{gateway.url}/?live")
                now = asyncio.get_running_loop().time()
                until = now + seconds
                web = [("fast", False), ("smart", True), ("fast", False)]
                evals = [("batch", False), ("fast", False), ("smart", False)]
                # web calls all along (two of its callers also ask flaky, and wait for it
                # until it is given up on); an eval run joins a third of the way in and
                # keeps the batch model's queue full to the end
                plans = [web] * 10 + [[*web, ("flaky", False)]] * 2
                callers = [client(gateway.url, KEYS["web"], p, now, until) for p in plans]
                callers += [
                    client(
                        gateway.url, KEYS["eval"], rng.sample(evals, 3), now + seconds / 3, until
                    )
                    for _ in range(24)
                ]
                shot = asyncio.ensure_future(asyncio.sleep(seconds - 2))
                load = asyncio.gather(*callers)
                await shot  # while the load still runs
                out.write_bytes(await asyncio.to_thread(browser.screenshot))
                await load
    sys.stdout.write(f"saved {out}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.output))
