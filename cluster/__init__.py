"""callboard's scheduler on Ray: one queue and one model actor per cluster (issue 17).

Importing what this package offers imports Ray (``pip install 'callboard[ray]'``);
callboard imports it only for a ``SystemConfig`` with a ``cluster``. Its names are
loaded when first used: a Ray worker that unpickles a queue or model shell imports
that shell's module, not the local assembly (pykka, the system's faces) besides,
which cost every actor process about half a second of start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from callboard.cluster._assembly import ClusterAssembly
    from callboard.cluster._connect import Connection, connect
    from callboard.messages import ClusterUnreachableError

__all__ = ["ClusterAssembly", "ClusterUnreachableError", "Connection", "connect"]

_HOMES = {
    "ClusterAssembly": "callboard.cluster._assembly",
    "Connection": "callboard.cluster._connect",
    "connect": "callboard.cluster._connect",
    "ClusterUnreachableError": "callboard.messages",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
