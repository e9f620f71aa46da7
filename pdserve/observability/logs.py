"""How every pdserve process logs: the one place logging is configured (``configure``).

``text`` is the readable format (time, level, logger, message); ``json`` writes one JSON object
a line, for log collectors: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, and,
where known, ``request_id`` and ``trace_id`` (a record's ``extra``) and ``worker_id`` (the
process's, once ``bind`` named it), plus ``exception`` with its traceback. The ``pdserve``
command configures it from ``--log-level`` and ``--log-format`` (or ``$PDSERVE_LOG_LEVEL``,
``$PDSERVE_LOG_FORMAT``, which it exports, so that the processes ``pdserve up`` starts log the
same way). Standard library only.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Literal, get_args

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Record attributes (set through ``extra=``) that a JSON line carries when a record has them.
_CONTEXT = ("request_id", "worker_id", "trace_id")


class JsonFormatter(logging.Formatter):
    """One JSON object a line; ``fields``: what every line of the process carries (``bind``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
        }
        for name in _CONTEXT:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str, log_format: LogFormat) -> None:
    """Log at ``level`` (a name: ``info``, ``WARNING``...) in ``log_format``, to stderr; replaces
    any configuration made before. ValueError naming a bad level or format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"log level must be one of debug, info, warning, error, critical; got {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def bind(**fields: str) -> None:
    """Fields every later JSON line of this process carries (``worker_id`` once it is known)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.fields.update(fields)
