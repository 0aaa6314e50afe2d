"""Synthetic traces against their profile; replay end to end (engine and a real server);
compare-modes; report PNGs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from streamgr.trace.format import read_header, read_trace
from streamgr.trace.report import write_report
from streamgr.trace.run import ReplayError, replay_trace
from streamgr.trace.stats import trace_stats
from streamgr.trace.synth import PROFILES, synth_trace, write_synth
from tests.conftest import small_overrides
from tests.protocol.helpers import ServerThread


@pytest.mark.slow
def test_synth_kuairand_profile_statistics():
    p = PROFILES["kuairand-1k"]
    trace = synth_trace("kuairand-1k", seed=3, users=200)
    lengths, per_user_times = {}, {}
    for r in trace:
        lengths[r.user] = lengths.get(r.user, 0) + len(r.items)
        per_user_times.setdefault(r.user, []).append(r.time)
    L = np.array(list(lengths.values()))
    assert abs(L.mean() - p.mean_history) / p.mean_history < 0.15, L.mean()
    assert L.min() >= 1 and L.max() <= p.max_history
    per_req = np.array([len(r.items) for r in trace])
    assert abs(per_req.mean() - p.events_per_request) / p.events_per_request < 0.15
    gaps = np.concatenate([np.diff(t) for t in per_user_times.values()])
    assert np.median(gaps) < 600  # bursty: most returns within minutes
    assert np.percentile(gaps, 99) > 1800  # a heavy tail returns much later:
    assert np.percentile(gaps, 99.9) > 4 * 3600  # hours, for some
    assert all(np.all(np.diff(t) >= 0) for t in per_user_times.values())


@pytest.mark.parametrize("users", [0, -3])
def test_synth_refuses_fewer_than_one_user(tmp_path, users):
    with pytest.raises(ValueError, match="--users must be at least 1"):
        write_synth("tiny", tmp_path / "t.trace", users=users)
    assert not (tmp_path / "t.trace").exists()


def test_synth_gen_profile(tmp_path):
    h = write_synth("gen", tmp_path / "g.trace", users=20, seed=1)
    assert read_header(tmp_path / "g.trace").kind == "generate" and h.records > 20
    rec = next(read_trace(tmp_path / "g.trace"))
    assert rec.top_k == 10 and rec.items


@pytest.fixture
def tiny_trace(tmp_path):
    write_synth("tiny", tmp_path / "t.trace", seed=2)
    return tmp_path / "t.trace"


def test_stats_with_spec(tiny_trace):
    from streamgr.config import load_spec
    s = trace_stats(tiny_trace, load_spec("rank-small"))
    assert s["users"] == 6 and s["requests"] > 6 and s["working_set_tokens"] > 0
    assert s["fits_embedding_tables"] is True


def test_replay_engine_compare_modes_and_report(tiny_trace, tmp_path):
    out = tmp_path / "r.jsonl"
    runs = replay_trace(tiny_trace, out, spec="rank-small", overrides=small_overrides(),
                        compare_modes=True, batch=2, progress=False)
    assert [r["mode"] for r in runs] == ["recompute", "gpu-only", "hierarchical"]
    assert runs[0]["total_hit_ratio"] == 0.0 and runs[2]["total_hit_ratio"] > 0.5
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    reqs = [x for x in lines if x["type"] == "request"]
    assert len(reqs) == 3 * runs[0]["requests"] and {"latency_ms", "tier", "stages"} <= set(reqs[0])
    files = write_report([out], tmp_path / "rep")
    pngs = [f for f in files if f.suffix == ".png"]
    assert len(pngs) == 4
    # A file whose last line was cut short (a replay killed while it wrote) is reported
    # without that line (before: refused whole); a bad line elsewhere is still refused.
    from streamgr.trace.report import load_results
    text = out.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[:len(text) - len(text.splitlines()[-1]) // 2 - 1])
    got = {label: len(reqs) for label, _, reqs in load_results([cut])}
    assert got == {"recompute": runs[0]["requests"], "gpu-only": runs[1]["requests"],
                   "hierarchical": runs[2]["requests"] - 1}
    bad = tmp_path / "bad.jsonl"
    lines = text.splitlines(keepends=True)
    bad.write_text("".join(lines[:5] + ['{"type": "requ\n'] + lines[5:]))
    with pytest.raises(ValueError, match=r"bad.jsonl:6: not a results line"):
        load_results([bad])
    for f in pngs:
        data = f.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "| hierarchical |" in (tmp_path / "rep" / "summary.md").read_text()


def test_replay_closed_loop_engine(tiny_trace, tmp_path):
    runs = replay_trace(tiny_trace, tmp_path / "r.jsonl", spec="rank-small",
                        overrides=small_overrides(**{"cache.mode": "hierarchical"}),
                        concurrency=4, progress=False)
    assert runs[0]["requests"] > 0 and runs[0]["errors"] == 0 and runs[0]["total_hit_ratio"] > 0


def test_replay_against_a_real_server(tiny_trace, tmp_path):
    with ServerThread("uvloop", overrides={"cache.mode": "hierarchical"}) as srv:
        runs = replay_trace(tiny_trace, tmp_path / "s.jsonl", server=srv.addr, concurrency=4,
                            progress=False)
        served = srv.counters()["rank_requests"]
    assert runs[0]["requests"] == served > 0 and runs[0]["errors"] == 0
    assert runs[0]["total_hit_ratio"] > 0


def test_replay_ids_that_do_not_fit_name_fold_ids(tmp_path):
    write_synth("small", tmp_path / "s.trace", users=3, seed=0)
    ov = small_overrides(**{"model.num_items": 50})
    with pytest.raises(ReplayError, match="--fold-ids"):
        replay_trace(tmp_path / "s.trace", tmp_path / "x.jsonl", spec="rank-small", overrides=ov,
                     progress=False)
    runs = replay_trace(tmp_path / "s.trace", tmp_path / "x.jsonl", spec="rank-small",
                        overrides=ov, fold_ids=True, limit=40, progress=False)
    assert runs[0]["requests"] + runs[0]["skipped_over_max_history"] == 40


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "streamgr", "trace", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    p = run("synth", "--profile", "tiny", "--seed", "1", "-o", str(tmp_path / "t.trace"))
    assert p.returncode == 0, p.stderr
    p = run("stats", str(tmp_path / "t.trace"), "--spec", "rank-small")
    assert p.returncode == 0 and "working set" in p.stdout
    p = run("replay", str(tmp_path / "t.trace"), "--spec", "rank-small", "--set",
            "engine.device=cpu", "--compare-modes", "--batch", "2", "-o", str(tmp_path / "r.jsonl"))
    assert p.returncode == 0, p.stderr
    assert "speed-up vs recompute" in p.stdout and "hierarchical" in p.stdout
    p = run("report", str(tmp_path / "r.jsonl"), "-o", str(tmp_path / "rep"))
    assert p.returncode == 0 and (tmp_path / "rep" / "latency_cdf.png").is_file()
    p = run("replay", str(tmp_path / "missing.trace"), "--spec", "rank-small", "-o", "x")
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_replay_generate_trace(tmp_path):
    write_synth("gen", tmp_path / "g.trace", users=8, seed=4)
    ov = {"engine.device": "cpu", "catalog.random_items": 1000}
    runs = replay_trace(tmp_path / "g.trace", tmp_path / "g.jsonl", spec="gen-small",
                        overrides=ov, limit=40, concurrency=4, progress=False)
    assert runs[0]["mode"] == "generate" and runs[0]["requests"] == 40 and runs[0]["errors"] == 0
    lines = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert {"encoder", "decoder", "selection"} <= set(lines[1]["stages"])
    with pytest.raises(ReplayError, match="--fold-ids"):
        replay_trace(tmp_path / "g.trace", tmp_path / "x.jsonl", spec="gen-small",
                     overrides={"engine.device": "cpu"}, limit=40, progress=False)
    with pytest.raises(ReplayError, match="serves no generate"):
        replay_trace(tmp_path / "g.trace", tmp_path / "x.jsonl", spec="rank-small",
                     overrides=small_overrides(), limit=4, progress=False)
    write_synth("tiny", tmp_path / "r.trace", users=4, seed=4)
    with pytest.raises(ReplayError, match="serves no rank"):  # the other way round
        replay_trace(tmp_path / "r.trace", tmp_path / "x.jsonl", spec="gen-small",
                     overrides={"engine.device": "cpu"}, limit=4, progress=False)
    assert not (tmp_path / "x.jsonl").exists()


def test_delta_replay_answers_as_full_histories():
    """replay_batches(delta=True): returning users send only their new events; the cached
    engine answers exactly as when every request carries the whole history."""
    from streamgr import Engine
    from streamgr.trace.replay import batches_of_distinct_users, replay_batches
    from streamgr.trace.synth import Timeline
    tl = Timeline(synth_trace("small", seed=1, users=12))
    n = 800  # of 2,132 requests: every user returns ~65 times (CI's time)
    batches = list(batches_of_distinct_users((tl.request(i) for i in range(n)), 4))
    ov = small_overrides(**{"cache.mode": "hierarchical", "model.max_history": 4096,
                            "model.num_items": 1000, "model.max_candidates": 64})
    out, known, deltas = {}, {}, {}
    for delta in (False, True):
        eng = Engine.from_spec("rank-small", ov)
        run, deltas[delta] = eng.run_batch, []

        def counting(reqs, *a, _run=run, _seen=deltas[delta], **kw):
            _seen.extend(r for r in reqs if r.base_len is not None)
            return _run(reqs, *a, **kw)
        eng.run_batch = counting
        res = replay_batches(eng, batches, keep_scores=True, progress=False, delta=delta)
        out[delta] = res.scores
        known[delta] = eng.stats()["cache"]["prefix_known_users"]
    assert len(out[True]) == n and len(batches) > 6
    assert not deltas[False] and len(deltas[True]) > len(batches)
    # Returning users' cached prefixes were known without hashing, full requests or deltas.
    assert known[True] == known[False] > 0
    for a, b in zip(out[False], out[True]):
        np.testing.assert_array_equal(a, b)


def test_replay_times_stages_on_every_nth_batch_only():
    """replay_batches(stage_every=N): only every N-th batch runs with stage syncs; its records
    say so, and the stage breakdown sums exactly those batches (the rest time batches as
    served). Without it every measured batch counts, as before."""
    from streamgr import Engine
    from streamgr.trace.replay import batches_of_distinct_users, replay_batches
    from streamgr.trace.synth import Timeline
    tl = Timeline(synth_trace("small", seed=2, users=8))
    batches = list(batches_of_distinct_users((tl.request(n) for n in range(len(tl.trace))), 4))[:7]
    ov = small_overrides(**{"model.max_history": 4096, "model.num_items": 1000,
                            "model.max_candidates": 64})
    eng = Engine.from_spec("rank-small", ov)
    synced_batches, run = [], eng.run_batch

    def spy(reqs, sync, **kw):
        synced_batches.append(sync)
        return run(reqs, sync, **kw)
    eng.run_batch = spy
    res = replay_batches(eng, batches, measure=range(1, 7), progress=False, stage_every=3)
    assert synced_batches == [True, False, False, True, False, False, True]
    assert res.batches == 6 and res.stage_batches == 2  # batches 3 and 6 (0 is not measured)
    assert {r.batch for r in res.records if r.synced} == {3, 6}
    assert res.stages["model"] > 0
    plain = replay_batches(eng, batches[:3], progress=False)
    assert plain.stage_batches == plain.batches == 3 and not any(r.synced for r in plain.records)


def test_results_are_written_whole_or_not_at_all(tmp_path):
    """A write that fails half-way (here a value the encoder refuses; in life a kill or a
    full disk) leaves the earlier results file as it was and no temporary file. Before: the
    file was truncated and half written."""
    from streamgr.trace.run import _write_results
    out = tmp_path / "r.jsonl"
    _write_results(out, [{"type": "run", "mode": "a"}])
    before = out.read_bytes()
    with pytest.raises(TypeError, match="cannot encode"):
        _write_results(out, [{"type": "run", "mode": "b"}, {"bad": object()}])
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
