"""The batch run's output file (callboard/_run_output.py): one run at a time writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from callboard.messages import Completed, UsageError
from support import write_lines

from callboard._run_output import exclusive
from callboard.batch import result_record


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_second_run_on_the_same_output_by_another_name_is_refused(
    tmp_path: Path, how: str
) -> None:
    """The lock went by the name given: two runs, one through a link, both wrote the
    file (1,784 ids doubled)."""
    a = json.dumps(result_record("a", Completed(task_id=3, trace_id="t", content="x")))
    real = write_lines(tmp_path / "real.jsonl", [a])
    other = tmp_path / "other.jsonl"
    if how == "symlink":
        other.symlink_to(real)
    else:
        other.hardlink_to(real)
    refused = pytest.raises(UsageError, match="another callboard run is writing")
    with exclusive(real), refused, exclusive(other):
        pass
    with exclusive(other):  # released: a later run may
        pass
