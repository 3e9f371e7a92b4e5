"""``callboard``'s public names: each loads on first use from its home module, so
``import callboard`` (and the command's start) loads no runtime."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from support import fresh

import callboard


def test_import_callboard_loads_no_runtime() -> None:
    """The public names load on first use (``callboard.__getattr__``)."""
    probe = "import callboard, sys; print(sorted({'pykka', 'httpx', 'aiohttp'} & set(sys.modules)))"
    assert fresh(probe) == "[]"


def test_every_public_name_is_the_object_its_home_module_holds() -> None:
    for name in callboard.__all__:
        home = callboard._HOMES[name]
        assert getattr(callboard, name) is getattr(importlib.import_module(home), name)
    assert set(callboard._HOMES) == set(callboard.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = callboard.Nope  # type: ignore[attr-defined]


def test_a_subpackage_is_an_attribute_as_it_was_before_the_names_loaded_lazily() -> None:
    """``import callboard; callboard.messages.Priority`` worked while the package loaded
    its names at once (found by a review)."""
    assert fresh("import callboard; print(callboard.messages.Priority.__name__)") == "Priority"
    assert dir(callboard) == sorted(callboard.__all__)


def test_the_source_folder_without_an_install_mapping_its_layers_names_the_way_out() -> None:
    """After ``pip install .``, Python started in the checkout's root imports this
    folder, without ``messages`` and the other layers beside it: a bare
    ``ModuleNotFoundError: No module named 'callboard.messages'`` (found by a docs
    audit). ``-S`` leaves out the editable install's mapping, as a plain install would."""
    root = Path(callboard.__file__).parent.parent
    ran = subprocess.run(
        [sys.executable, "-S", "-c", "import callboard"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 1
    assert "ImportError: callboard is imported from its source folder" in ran.stderr
    assert "install it editable (pip install -e .)" in ran.stderr
