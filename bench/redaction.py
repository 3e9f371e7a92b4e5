"""Scenario ``redaction``: what hiding the process's secrets costs, by how many it holds.

Every answer a provider sends, and every streamed delta, goes through the process's
redactor (``runtime/redact.py``) before anything reads it. A host that builds a
system for each of its customers' keys registers them all, so what a text costs must
follow the text, not the number of keys. Measured in process, on one thread, in CPU
time (the median of rounds, each as many repetitions as fill its share of time),
with 1 to 1,000 keys of OpenAI's shape (``sk-proj-`` and 43 random characters): a
chat completion of about 1 KB (``hide``); the same naming the keys' public start
(``sk-proj-``), which each key's loose search must then rule out; a delta of a
streamed text (``hide_after``, as the stream's guard calls it); an answer of 256
embeddings in base64 (364 KB); and a hostile answer, the keys' public start
repeated, with 100 keys.

Figures: microseconds per text at each count; the cost with the most keys over the
cost with one (``answer_flatness``, ``delta_flatness``); the hostile answer's CPU
seconds and its size.
"""

from __future__ import annotations

import base64
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
_SAID = '"content": "'


def run_redaction(opts: Options) -> ScenarioResult:
    scale = opts.scale
    rng = random.Random(opts.seed)
    counts = KEY_COUNTS if not scale.quick else KEY_COUNTS[:3]
    share_s, rounds = scale.redaction_share_s, scale.redaction_rounds
    result = ScenarioResult(name=NAME)
    result.settings = {
        "key_counts": list(counts),
        "rounds": rounds,
        "share_s": share_s,
        "gated_from_needles": GATED_FROM,
        "hostile_repeats": scale.redaction_hostile_repeats,
    }
    keys = [_key(rng) for _ in range(max(counts))]
    answer, delta = _answer(rng), "The quick brown fox ju"
    texts = {
        "answer": functools.partial(Redactor.hide, text=answer),
        "named": functools.partial(Redactor.hide, text=answer.replace(_SAID, _SAID + "sk-proj- ")),
        "embeddings": functools.partial(Redactor.hide, text=_embeddings(rng)),
        "delta": functools.partial(Redactor.hide_after, text="and so " + delta, start=7),
    }
    costs: dict[str, dict[str, float]] = {name: {} for name in texts}
    for n in counts:
        r = Redactor(keys[:n])
        for name, hide in texts.items():
            costs[name][str(n)] = _median_us(functools.partial(hide, r), rounds, share_s)
    most, one = str(max(counts)), str(min(counts))
    hostile = "sk-proj " * scale.redaction_hostile_repeats
    r = Redactor(keys[:HOSTILE_KEYS])
    began = time.process_time()
    r.hide(hostile)
    hostile_s = time.process_time() - began
    result.figures = {
        "answer_bytes": len(answer.encode()),
        **{f"{name}_us": by_count for name, by_count in costs.items()},
        "answer_flatness": round(costs["answer"][most] / costs["answer"][one], 2),
        "delta_flatness": round(costs["delta"][most] / costs["delta"][one], 2),
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


def _embeddings(rng: random.Random) -> str:
    """An embeddings answer of 256 vectors of 256 dimensions in base64 (364 KB)."""
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(rng.randbytes(1024)).decode("ascii"),
        }
        for i in range(256)
    ]
    usage = {"prompt_tokens": 3000, "total_tokens": 3000}
    return json.dumps({"object": "list", "data": data, "model": "m", "usage": usage})


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
