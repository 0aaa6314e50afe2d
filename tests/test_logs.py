"""``streamgr.logs``: the JSON formatter's keys, extras and tracebacks; ``configure``
replaces its own handler instead of adding a second, and leaves a root logger that someone
else set up alone."""

from __future__ import annotations

import contextlib
import io
import json
import logging

from streamgr.logs import JsonFormatter, configure


@contextlib.contextmanager
def bare_root():
    """A root logger without handlers, as a CLI process starts (pytest's capture handlers,
    installed around each test's call, put back afterwards)."""
    root = logging.getLogger()
    ours = logging.getLogger("streamgr")
    handlers, level, our_level = list(root.handlers), root.level, ours.level
    for h in handlers:
        root.removeHandler(h)
    try:
        yield root
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        ours.setLevel(our_level)


def test_json_lines_hold_extras_and_tracebacks():
    buf = io.StringIO()
    with bare_root() as root:
        configure("INFO", "json", buf)
        configure("INFO", "json", buf)  # again: still one handler, one line a record
        assert len(root.handlers) == 1
        log = logging.getLogger("streamgr.test")
        log.info("served %d", 3, extra={"user": "u1", "ms": 1.5})
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed")
        root.debug("not at INFO")
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert len(rows) == 2, rows
    assert rows[0]["message"] == "served 3" and rows[0]["user"] == "u1" and rows[0]["ms"] == 1.5
    assert rows[0]["logger"] == "streamgr.test" and rows[0]["level"] == "INFO"
    assert "ValueError: bad" in rows[1]["exc"] and rows[1]["level"] == "ERROR"
    assert "args" not in rows[0] and "msg" not in rows[0]  # the record's own attributes stay out


def test_text_format_and_objects_that_json_cannot_hold():
    buf = io.StringIO()
    with bare_root():
        configure("WARNING", "text", buf)
        logging.getLogger("streamgr.test").warning("careful")
    assert buf.getvalue().rstrip().endswith("WARNING streamgr.test: careful")
    rec = logging.LogRecord("x", logging.INFO, "", 0, "m", None, None)
    rec.peer = ("127.0.0.1", 5)
    rec.obj = object()
    out = json.loads(JsonFormatter().format(rec))
    assert out["peer"] == ["127.0.0.1", 5] and out["obj"].startswith("<object object")


def test_a_root_logger_someone_else_set_up_is_left_alone():
    with bare_root() as root:
        other = logging.StreamHandler(io.StringIO())
        root.addHandler(other)
        configure("DEBUG", "json", io.StringIO())
        assert root.handlers == [other]


def test_other_packages_info_stays_out_unless_debug():
    """At INFO the server's lines pass and third-party INFO (torch's fake-tensor statistics on
    an interrupted start) does not; their warnings do; at DEBUG everything passes."""
    buf = io.StringIO()
    with bare_root():
        configure("INFO", "text", buf)
        logging.getLogger("streamgr.server").info("listening")
        logging.getLogger("thirdparty.stats").info("cache stats")
        logging.getLogger("numba.core").warning("deprecated")
        lines = buf.getvalue().splitlines()
        assert len(lines) == 2, lines
        assert lines[0].endswith("INFO streamgr.server: listening")
        assert lines[1].endswith("WARNING numba.core: deprecated")
        configure("DEBUG", "text", buf)
        logging.getLogger("thirdparty.module").debug("guards")
        logging.getLogger("streamgr.engine").debug("plan")
        assert [line.split(" ", 2)[2] for line in buf.getvalue().splitlines()[2:]] == [
            "DEBUG thirdparty.module: guards", "DEBUG streamgr.engine: plan"]
        configure("ERROR", "text", buf)
        before = buf.getvalue()
        logging.getLogger("streamgr.server").warning("not at ERROR")
        assert buf.getvalue() == before
