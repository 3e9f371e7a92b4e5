"""The cluster scenario (bench/cluster.py): what runs without a Ray cluster. The
scenario itself runs on one in ``callboard bench``; the shared actors it measures are
tested on the test run's cluster in ``tests/cluster``."""

from __future__ import annotations

import inspect

from callboard.bench.cluster import _Sink
from callboard.cluster._model import ModelShell


def test_the_queue_figure_s_sink_takes_whatever_the_queue_sends_a_model() -> None:
    # the queue's batch to a model grew an argument (how many tickets still wait); the
    # sink standing in for a model took three, Ray refused the queue's call at once, and
    # the full bench's cluster scenario ended in a TypeError
    sent = list(inspect.signature(ModelShell.call).parameters)  # self and all it takes
    inspect.signature(_Sink.call).bind(*[None] * len(sent))
