"""Logging helpers: every callboard record can show its task id and trace id.

Records about one task carry ``task_id`` and ``trace_id`` attributes; others
do not. ``TaskLogFilter`` gives every record both (``-`` when absent) so one
format string serves all records::

    handler.addFilter(callboard.TaskLogFilter())
    handler.setFormatter(logging.Formatter(callboard.LOG_FORMAT))
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [task=%(task_id)s trace=%(trace_id)s] %(message)s"


class TaskLogFilter(logging.Filter):
    """Adds ``task_id``/``trace_id`` = ``-`` to records that have none; drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "task_id"):
            record.task_id = "-"
        if not hasattr(record, "trace_id"):
            record.trace_id = "-"
        return True
