"""The README's examples run as written (on the embedded simulated provider)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def test_the_wire_example_runs_and_says_what_it_promises(
    capsys: pytest.CaptureFixture[str],
) -> None:
    (block,) = [b for b in _blocks() if "tools=[weather]" in b]
    exec(compile("import callboard\n" + block, "README.md", "exec"), {})  # noqa: S102 - our own README
    out = capsys.readouterr().out
    assert "weather {'city':" in out
    assert "{'name':" in out  # the parsed JSON
    assert "Usage(prompt_tokens=" in out
    assert "\n2 256 " in out  # two vectors of the dimensions asked
