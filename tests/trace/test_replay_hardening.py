"""The newcomer's findings of issue 11 in the trace tool: open-loop replays finish and write their
results; replays against a server show failures and refuse engine-only options; report names
its missing extra."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from streamgr.errors import StreamgrError
from streamgr.trace import report
from streamgr.trace.run import ReplayError, replay_trace
from streamgr.trace.synth import write_synth
from tests.conftest import small_overrides
from tests.protocol.helpers import ServerThread


@pytest.fixture
def tiny_trace(tmp_path):
    write_synth("tiny", tmp_path / "t.trace", seed=2)
    return tmp_path / "t.trace"


def test_open_loop_replay_writes_its_results(tiny_trace, tmp_path):
    out = tmp_path / "r.jsonl"
    runs = replay_trace(tiny_trace, out, spec="rank-small", overrides=small_overrides(),
                        rate=200.0, progress=False)
    assert runs[0]["requests"] > 0 and runs[0]["errors"] == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    reqs = [x for x in lines if x["type"] == "request"]
    assert len(reqs) == runs[0]["requests"] and all(r["latency_ms"] > 0 for r in reqs)


def test_open_loop_cli_generate(tmp_path):
    write_synth("gen", tmp_path / "g.trace", users=4, seed=4)
    p = subprocess.run([sys.executable, "-m", "streamgr", "trace", "replay", str(tmp_path / "g.trace"),
                        "--spec", "gen-small", "--set", "engine.device=cpu", "--set",
                        "catalog.random_items=1000", "--rate", "100", "--limit", "12", "-o",
                        str(tmp_path / "g.jsonl")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "generate" in p.stdout and "Traceback" not in p.stderr
    run = json.loads((tmp_path / "g.jsonl").read_text().splitlines()[0])
    assert run["type"] == "run" and run["requests"] == 12


def test_server_replay_shows_failures(tmp_path):
    write_synth("small", tmp_path / "s.trace", users=3, seed=0)  # ids past 200 items
    with ServerThread("uvloop") as srv:
        out = tmp_path / "s.jsonl"
        runs = replay_trace(tmp_path / "s.trace", out, server=srv.addr, limit=30,
                            concurrency=4, progress=False)
        p = subprocess.run([sys.executable, "-m", "streamgr", "trace", "replay",
                            str(tmp_path / "s.trace"), "--server", srv.addr, "--limit", "30",
                            "-o", str(tmp_path / "c.jsonl")], capture_output=True, text=True,
                           timeout=300)
    assert runs[0]["errors"] > 0 and runs[0]["error_codes"]
    errors = [json.loads(x) for x in out.read_text().splitlines() if '"error"' in x]
    assert len([e for e in errors if e["type"] == "error"]) == runs[0]["errors"]
    assert p.returncode == 1 and "requests failed" in p.stderr
    assert "pass --fold-ids" in p.stderr  # the ids' failures name the option that folds them


def test_server_replay_folds_ids_into_the_served_tables(tmp_path):
    """``--fold-ids`` against a server folds a rank trace's ids into the tables the server's
    stats report (``limits``): the trace whose ids fail above replays without an error."""
    write_synth("small", tmp_path / "s.trace", users=3, seed=0)  # ids past 200 items
    with ServerThread("uvloop") as srv:
        limits = srv.engine.stats()["limits"]
        runs = replay_trace(tmp_path / "s.trace", tmp_path / "s.jsonl", server=srv.addr,
                            limit=30, concurrency=4, progress=False, fold_ids=True)
    assert limits == srv.engine.spec.rank_limits and limits["num_items"] == 200
    assert runs[0]["requests"] == 30 and runs[0]["errors"] == 0, runs[0]


def test_server_replay_fold_ids_needs_the_servers_limits(tmp_path, monkeypatch):
    """A server whose stats carry no rank limits: ``--fold-ids`` stops with an error naming
    them, before any request (without the option the replay runs as it did)."""
    from streamgr.config import Spec
    monkeypatch.setattr(Spec, "rank_limits", property(lambda self: None))
    write_synth("small", tmp_path / "s.trace", users=3, seed=0)
    with ServerThread("asyncio") as srv:
        with pytest.raises(ReplayError, match="reports no rank model's limits"):
            replay_trace(tmp_path / "s.trace", tmp_path / "s.jsonl", server=srv.addr, limit=5,
                         progress=False, fold_ids=True)
        assert srv.counters().get("rank_requests", 0) == 0
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("option", [{"batch": 2}, {"compare_modes": True},
                                    {"overrides": {"cache.mode": "recompute"}}])
def test_server_replay_refuses_engine_options(tiny_trace, tmp_path, option):
    with pytest.raises(ReplayError, match="cannot apply to a rank replay against a server"):
        replay_trace(tiny_trace, tmp_path / "x.jsonl", server="127.0.0.1:1", progress=False,
                     **option)


def test_server_generate_replay_refuses_fold_ids(tmp_path):
    """A generate trace's ids fold into the spec's catalog, which a server does not report."""
    write_synth("gen", tmp_path / "g.trace", users=2, seed=4)
    with pytest.raises(ReplayError, match="--fold-ids cannot apply to a generate replay"):
        replay_trace(tmp_path / "g.trace", tmp_path / "x.jsonl", server="127.0.0.1:1",
                     progress=False, fold_ids=True)


@pytest.mark.parametrize("option,flag", [({"rate": 0.0}, "--rate"), ({"rate": -5.0}, "--rate"),
                                         ({"rate": float("nan")}, "--rate"),
                                         ({"concurrency": 0}, "--concurrency"),
                                         ({"batch": 0}, "--batch"), ({"limit": 0}, "--limit"),
                                         ({"candidates": 0}, "--candidates")])
def test_replay_refuses_empty_or_negative_load_options(tiny_trace, tmp_path, option, flag):
    """Each was taken as "unset" (0 is falsy), replayed nothing, failed every request, or
    reached numpy's "scale < 0": now an error that names the flag, before any request."""
    out = tmp_path / "x.jsonl"
    with pytest.raises(ReplayError, match=rf"{flag} must be"):
        replay_trace(tiny_trace, out, spec="rank-small", overrides=small_overrides(),
                     progress=False, **option)
    assert not out.exists()


def test_report_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(StreamgrError, match=r"streamgr\[trace\]"):
        report.write_report([tmp_path / "none.jsonl"], tmp_path / "rep")


def test_ctrl_c_writes_the_results_so_far(tiny_trace, tmp_path):
    import signal
    import time
    out = tmp_path / "partial.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "streamgr", "trace", "replay", str(tiny_trace),
                          "--spec", "rank-small", "--set", "engine.device=cpu", "--rate", "10",
                          "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t_end = time.monotonic() + 120
    err = ""
    while time.monotonic() < t_end:  # the estimate line shows the replay has started
        line = p.stderr.readline()
        err += line
        if "open loop at 10/s: about" in line:
            break
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    _, rest = p.communicate(timeout=60)
    assert p.returncode == 130, err + rest
    assert "answered requests written to" in rest
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["type"] == "run" and lines[0]["interrupted"] is True
    assert 0 < lines[0]["requests"] == sum(1 for x in lines if x["type"] == "request")


def test_report_of_generate_results_and_batch_tiers(tmp_path, tiny_trace):
    write_synth("gen", tmp_path / "g.trace", users=4, seed=4)
    replay_trace(tmp_path / "g.trace", tmp_path / "g.jsonl", spec="gen-small",
                 overrides={"engine.device": "cpu", "catalog.random_items": 1000}, limit=16,
                 concurrency=4, progress=False)
    files = report.write_report([tmp_path / "g.jsonl"], tmp_path / "rep")
    names = {f.name for f in files}
    assert {"latency_cdf.png", "latency_over_time.png", "queue_compute.png", "stages.png",
            "summary.md"} <= names and "hit_ratio.png" not in names
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "g.trace, spec gen-small, cpu" in summary
    # --batch: each request carries its batch, the tier plot counts each batch once
    replay_trace(tiny_trace, tmp_path / "b.jsonl", spec="rank-small",
                 overrides=small_overrides(**{"cache.mode": "hierarchical"}), batch=2,
                 progress=False)
    recs = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    reqs = [r for r in recs if r["type"] == "request"]
    assert all("batch" in r for r in reqs) and recs[0]["device"] == "cpu"
    files = report.write_report([tmp_path / "b.jsonl"], tmp_path / "rep2")
    assert {"hit_ratio.png", "latency_by_tier.png"} <= {f.name for f in files}


def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path):
    """Before: a replay ran to its end (hours on a long trace), then lost its results to
    ``[Errno 2] No such file or directory: '...tmp-PID'``; a conversion read the whole log
    first. Now the output path is checked first: here the input does not even exist, and
    the error is the output's."""
    from streamgr.trace.convert import convert_movielens
    from streamgr.trace.format import TraceError
    missing = tmp_path / "no-such-folder"
    with pytest.raises(TraceError, match=r"-o .*r\.jsonl: no folder .*no-such-folder"):
        replay_trace(tmp_path / "absent.trace", missing / "r.jsonl", spec="rank-small")
    with pytest.raises(TraceError, match="is a folder; give a file path"):
        replay_trace(tmp_path / "absent.trace", tmp_path, spec="rank-small")
    with pytest.raises(TraceError, match="no folder"):
        convert_movielens(tmp_path / "absent.data", missing / "m.trace", progress=False)
    with pytest.raises(TraceError, match="no folder"):
        write_synth("tiny", missing / "t.trace")
    assert not missing.exists()
