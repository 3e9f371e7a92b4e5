"""callboard's scheduler on Ray: one queue and one model actor per cluster (issue 17).

Importing this package imports Ray (``pip install 'callboard[ray]'``); callboard
imports it only for a ``SystemConfig`` with a ``cluster``.
"""

from callboard.cluster._assembly import ClusterAssembly
from callboard.cluster._connect import Connection, connect
from callboard.messages import ClusterUnreachableError

__all__ = ["ClusterAssembly", "ClusterUnreachableError", "Connection", "connect"]
