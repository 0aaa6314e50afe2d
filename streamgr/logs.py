"""Logging set-up for the command line: the text format on stderr, or one JSON object a line
(``--log-format json``) for log pipelines that index fields (Loki, Elasticsearch, Cloud
Logging). A record's ``extra`` fields become keys of its object (the access log's peer, kind,
id, user, outcome and ms), so nothing has to be parsed back out of the message."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What every LogRecord carries: anything else on a record came from ``extra``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object a record: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``,
    ``message``, the record's extra fields, and ``exc`` with the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, timezone.utc)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, fmt: str = "text", stream=None) -> None:
    """streamgr's loggers at ``level`` on ``stream`` (stderr) in ``fmt`` (``text`` or
    ``json``), replacing the handler an earlier call set. Other packages' loggers (torch, Numba,
    CuPy) pass at ``level`` only for DEBUG, else from WARNING up: at INFO an operator reads the
    server's lines, not torch's fake-tensor statistics on an interrupted start. Like
    ``logging.basicConfig``, it leaves alone a root logger whose handlers someone else set (a
    program or a test runner calling the CLI's ``main``)."""
    num = logging.getLevelName(level) if isinstance(level, str) else level
    if not isinstance(num, int):  # (before any handler changes)
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "streamgr_cli", False)]
    if len(ours) < len(root.handlers):
        return
    for h in ours:
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.streamgr_cli = True
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    logging.getLogger("streamgr").setLevel(num)
    root.setLevel(num if num <= logging.DEBUG else max(num, logging.WARNING))
