"""The machinery a System runs on (callboard/_assembly.py): here, a model's restart ends
its dead incarnation's calls before the successor starts, whatever the I/O loop's lag."""

from __future__ import annotations

import asyncio
import threading

import pytest
from callboard.messages import Completed, Crash
from callboard.provider.server import ModelBehaviour, SimulatedProvider
from support import WAIT_S, running, served, wait_until

import callboard._assembly as assembly
from callboard import ModelSettings


def test_a_stream_whose_model_crashes_before_its_first_delta_gets_one_answer(
    provider: SimulatedProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dead incarnation's client was closed on the loop's next turn: a stream whose
    first delta had not come when the successor looked was sent again while the dead
    call still wrote into it, and the reader got both answers mixed, the task ending
    Completed (found by a review). Here the loop reaches a deferred close late, as under
    load: the restart must not wait for it."""
    late = threading.Event()
    close_later = assembly._close_later

    def reached_late(client: object) -> None:
        late.set()
        asyncio.get_running_loop().call_later(0.6, close_later, client)

    monkeypatch.setattr(assembly, "_close_later", reached_late)
    provider.configure("m", ModelBehaviour(latency_s=0.0, ttft_s=0.3, token_gap_s=0.02))
    with running(ModelSettings(name="m", base_url=provider.base_url)) as system:
        stream = system.stream("a story", model="m", max_tokens=20)
        assert wait_until(lambda: served(provider, "m").get("requests") == 1)
        system.tell("model:m", Crash(reason="a crash before the stream's first delta"))
        heard = "".join(d.text for d in stream)
        result = stream.result(WAIT_S)
    assert isinstance(result, Completed), result
    assert heard == result.content  # one answer, whole, not two mixed
    assert not late.is_set()  # the restart did not leave the dead calls to a later turn
