"""``callboard.cluster``'s names load on first use, so a Ray worker that unpickles a
queue or model shell imports that shell's module and what it needs, not the local
assembly (pykka and the system's faces): every actor process started faster."""

from __future__ import annotations

import importlib

import callboard.cluster
import pytest
from support import fresh


@pytest.mark.parametrize("shell", ["callboard.cluster._queue", "callboard.cluster._model"])
def test_a_shells_module_loads_without_the_assembly(shell: str) -> None:
    probe = (
        f"import sys, {shell}; "
        "print(sorted({'callboard.cluster._assembly', 'pykka'} & set(sys.modules)))"
    )
    assert fresh(probe) == "[]"


def test_every_name_is_the_object_its_home_module_holds() -> None:
    for name in callboard.cluster.__all__:
        home = callboard.cluster._HOMES[name]
        assert getattr(callboard.cluster, name) is getattr(importlib.import_module(home), name)
    assert set(callboard.cluster._HOMES) == set(callboard.cluster.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = callboard.cluster.Nope  # type: ignore[attr-defined]
