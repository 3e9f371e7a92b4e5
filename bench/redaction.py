"""Scenario ``redaction``: what hiding the process's secrets costs, by how many it holds.

Every answer a provider sends, and every streamed delta, goes through the process's
redactor (``runtime/redact.py``) before anything reads it. A host that builds a
system for each of its customers' keys registers them all, so what a text costs must
follow the text, not the number of keys. Measured in process, on one thread, in CPU
time (the median of rounds, each as many repetitions as fill its share of time): a
chat completion of about 1 KB (``hide``) and a delta of a streamed text
(``hide_after``, as the stream's guard calls it), with 1 to 1,000 keys of OpenAI's
shape (``sk-proj-`` and 43 random characters), the way the redactor does it (through
its gate from about three keys on, ``GATED_FROM``) and searching every form
(``gated=False``) beside it; then a hostile answer, the keys' public start
(``sk-proj ``) repeated, with 100 keys.

Figures: microseconds per answer and per delta at each count, both ways; the cost
with the most keys over the cost with one (``answer_flatness``,
``delta_flatness``); the hostile answer's CPU seconds and its size.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import string
import time
from collections.abc import Callable

from callboard.bench.measure import ScenarioResult
from callboard.bench.plan import Options
from callboard.runtime.redact import GATED_FROM, Redactor

__all__ = ["run_redaction"]

NAME = "redaction"
KEY_COUNTS = (1, 10, 100, 1000)
HOSTILE_KEYS = 100
_ALPHABET = string.ascii_letters + string.digits + "-_"


def run_redaction(opts: Options) -> ScenarioResult:
    scale = opts.scale
    rng = random.Random(opts.seed)
    counts = KEY_COUNTS if not scale.quick else KEY_COUNTS[:3]
    share_s, rounds = scale.redaction_share_s, scale.redaction_rounds
    result = ScenarioResult(name=NAME)
    result.settings = {
        "key_counts": list(counts),
        "rounds": scale.redaction_rounds,
        "share_s": share_s,
        "gated_from_needles": GATED_FROM,
        "hostile_repeats": scale.redaction_hostile_repeats,
    }
    keys = [_key(rng) for _ in range(max(counts))]
    answer, delta = _answer(rng), "The quick brown fox ju"
    per_answer: dict[str, dict[str, float]] = {"redactor": {}, "searching": {}}
    per_delta: dict[str, dict[str, float]] = {"redactor": {}, "searching": {}}
    for n in counts:
        for way, gated in (("redactor", None), ("searching", False)):
            r = Redactor(keys[:n], gated=gated)
            hide = functools.partial(r.hide, answer)
            per_answer[way][str(n)] = _median_us(hide, rounds, share_s)
            hide_after = functools.partial(r.hide_after, "and so " + delta, 7)  # as a guard does
            per_delta[way][str(n)] = _median_us(hide_after, rounds, share_s)
    most, one = str(max(counts)), str(min(counts))
    hostile = "sk-proj " * scale.redaction_hostile_repeats
    r = Redactor(keys[:HOSTILE_KEYS])
    began = time.process_time()
    r.hide(hostile)
    hostile_s = time.process_time() - began
    result.figures = {
        "answer_bytes": len(answer.encode()),
        "answer_us": per_answer,
        "delta_us": per_delta,
        "answer_flatness": round(per_answer["redactor"][most] / per_answer["redactor"][one], 2),
        "delta_flatness": round(per_delta["redactor"][most] / per_delta["redactor"][one], 2),
        "hostile_bytes": len(hostile),
        "hostile_keys": HOSTILE_KEYS,
        "hostile_cpu_s": round(hostile_s, 3),
    }
    return result


def _key(rng: random.Random) -> str:
    return "sk-proj-" + "".join(rng.choices(_ALPHABET, k=43))


def _answer(rng: random.Random) -> str:
    """A chat completion's body as OpenAI sends it, about 1 KB."""
    words = [
        "the",
        "a",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "and",
        "then",
        "runs",
        "far",
        "away",
    ]
    content = " ".join(rng.choices(words, k=150))
    return json.dumps(
        {
            "id": "chatcmpl-" + "".join(rng.choices(_ALPHABET, k=29)),
            "object": "chat.completion",
            "created": 1764892800,
            "model": "gpt-4o-mini-2024-07-18",
            "system_fingerprint": "fp_44709d6fcb",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 19, "completion_tokens": 150, "total_tokens": 169},
        }
    )


def _median_us(call: Callable[[], object], rounds: int, share_s: float) -> float:
    """``call``'s CPU time in microseconds, the median over rounds of each round's mean
    (a round repeats it until ``share_s`` of CPU has gone)."""
    means = []
    for _ in range(rounds):
        n, began = 0, time.process_time()
        while (spent := time.process_time() - began) < share_s or n < 3:
            call()
            n += 1
        means.append(1e6 * spent / n)
    return round(statistics.median(means), 2)
