"""tools/profile_rank.py runs end to end (on the CPU here: the cached rank batches it replays,
the profiler's table, the per-batch stages)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_profile_rank_runs_on_the_cpu():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_rank.py"), "--spec",
                        "rank-small", "--device", "cpu", "--profile-name", "small", "--batches",
                        "4", "--profile", "2", "--rows", "5"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "aten::" in p.stdout and "stages per batch" in p.stdout
    assert "profile_rank rank-small: 2 batches of 8" in p.stdout


@pytest.mark.slow
def test_probe_hosthit_runs_on_the_cpu():
    """tools/probe_hosthit.py interleaves its configurations over host-hit batches and prints
    each one's latency against recompute and its stages, then traces two batches' host calls."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_hosthit.py"), "--spec",
                        "rank-small", "--device", "cpu", "--profile", "small", "--users", "40",
                        "--warmup", "40", "--window", "96", "--set", "cache.device_pages=64",
                        "--configs", "1.0:0", "0.0::nopad", "auto::torch+thread+fixed", "auto::early", "--trace", "auto", "0.0",
                        "--cprofile", "5"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    for config in ("1.0:0", "0.0::nopad", "auto::torch+thread+fixed", "auto::early"):
        m = re.search(rf"^{re.escape(config)}: (\d+) host-hit batches, mean [\d.]+ ms .*"
                      rf"recompute [\d.]+ ms", p.stdout, re.M)
        assert m and int(m.group(1)) > 0, p.stdout[-2000:]
    assert "stages ms: {" in p.stdout
    assert "Ordered by: cumulative time" in p.stdout and "(_submit)" in p.stdout  # --cprofile
    assert "split feedback: scale 1.000 after 0 updates" in p.stdout  # no device timings here
    assert re.search(r"^0\.0::nopad: .*host tokens recomputed [1-9]", p.stdout, re.M), p.stdout
    assert re.search(r"^trace auto batch 0: \d+ us on the host", p.stdout, re.M), p.stdout
    assert "kernels of recompute, us per batch (mean of 2):" in p.stdout, p.stdout[-2000:]
    assert re.search(r"^trace 0\.0 batch 1: \d+ us on the host", p.stdout, re.M), p.stdout


def test_probe_hosthit_kernel_table_sums_device_events_inside_each_range():
    """The probe's kernel table: device events starting inside the marked ranges, summed by
    name and divided by the ranges; host ops and events outside every range left out."""
    sys.path.insert(0, str(ROOT / "tools"))
    from probe_hosthit import kernel_table

    def ev(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    trace = [ev("b0", "user_annotation", 0, 100), ev("b1", "user_annotation", 200, 100),
             ev("gemm", "kernel", 10, 30), ev("gemm", "kernel", 210, 50),
             ev("attn", "kernel", 60, 20), ev("Memcpy HtoD", "gpu_memcpy", 220, 4),
             ev("aten::mm", "cpu_op", 10, 90), ev("gemm", "kernel", 150, 1000)]
    rows = kernel_table(trace, ["b0", "b1"])
    assert rows[0] == ("gemm", 40.0, 1.0)
    assert rows[1] == ("attn", 10.0, 0.5)
    assert rows[2] == ("Memcpy HtoD", 2.0, 0.5)
    assert rows[-1] == ("total (3 kinds)", 52.0, 2.0)


def test_profile_rank_host_times_host_hit_batches_on_the_cpu():
    """tools/profile_rank_host.py stubs the forward out and times the host work of host-hit
    batches (its stub once fell behind ``_forward_eager``'s signature and the tool died)."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_rank_host.py"), "--mode",
                        "hierarchical", "--users", "20", "--requests", "60", "--set",
                        "cache.device_pages=256", "--set", "cache.host_chunks=64", "--set",
                        "cache.onload_split=0.5", "--top", "3"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"^hierarchical, batch 8: \d+ batches, [\d.]+ ms per batch", p.stdout,
                     re.M), p.stdout
    assert "'onload_submit': " in p.stdout and "function calls" in p.stdout
    m = re.search(r"^history tokens: from gpu [\d,]+, from host ([\d,]+), host recomputed "
                  r"([\d,]+)", p.stdout, re.M)
    assert m and int(m.group(1).replace(",", "")) > 0, p.stdout  # host hits onloaded
    assert int(m.group(2).replace(",", "")) > 0, p.stdout  # and recomputed by the split


def test_probe_recompute_runs_on_the_cpu():
    """tools/probe_recompute.py's three probes, in turn on one engine, print what they
    measured."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_recompute.py"), "variants",
                        "per-batch", "cprofile", "--spec", "rank-small", "--profile", "small",
                        "--device", "cpu", "--users", "30", "--batches", "2"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    for want in ("unsynced+devsync   n=2", "ms/rows: ", "function calls"):
        assert want in p.stdout, (want, p.stdout[-1000:])


@pytest.mark.slow
def test_bench_update_refits_from_checkpoints_on_the_cpu():
    """tools/bench_update.py --checkpoints --rounds 2: refits from checkpoint directories
    written before the timed phases, in two rounds of both phases (items taken down in the
    first stay down in the second), every answer on a version that was active, none failed
    (its exit code); it says where the weights came from, the ratio of each round and which
    update phase the requests overlapped."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_update.py"), "--spec",
                        "gen-small", "--rate", "50", "--seconds", "1.5", "--every", "0.4",
                        "--catalog-every", "2", "--checkpoints", "2", "--rounds", "2"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:] + p.stdout[-2000:]
    m = re.search(r"from 2 checkpoints \((\d+) updates, (\d+) with catalog", p.stdout)
    assert m and int(m.group(1)) >= 2 and int(m.group(2)) >= 1, p.stdout[-1000:]
    assert re.search(r"p99 ratio per round: [\d.]+x, [\d.]+x\n", p.stdout), p.stdout[-1000:]
    # (requests overlapping some update phase; which one varies: a tiny spec's refit from a
    # checkpoint takes a few ms, and on a loaded 2-core machine no request may fall inside it)
    assert re.search(r"during (?!none)\w+ +\d+ requests", p.stdout), p.stdout[-3000:]
    assert "unknown-version answers 0" in p.stdout and "failed 0" in p.stdout
    assert "removed items answered 0" in p.stdout
    assert re.search(r"phase durations ms \(p50 / max\): .*weights [\d.]+ / [\d.]+", p.stdout)
    assert "event-loop stalls > 4 ms by phase" in p.stdout
    assert re.search(r"event-loop stalls overlapping a collection: \d+ of \d+", p.stdout)


def test_stall_watch_names_each_threads_place_during_a_stall():
    """tools/stall_watch.py: while the heartbeat is late the watchdog snapshots every thread;
    the report names the stall's length and each thread's most common place in it."""
    import threading
    import time
    sys.path.insert(0, str(ROOT / "tools"))
    from stall_watch import StallWatch

    def spin(stop):  # a second thread, somewhere in Python
        while not stop.is_set():
            time.sleep(0.001)
    stop = threading.Event()
    other = threading.Thread(target=spin, args=(stop,), name="spinner")
    other.start()
    with StallWatch(over=0.005) as watch:
        time.sleep(0.02)  # the watch's thread starts its heartbeat
        watch.beat()
        t0 = time.perf_counter()
        time.sleep(0.1)  # no beat: a stall
        lag = time.perf_counter() - t0
    stop.set()
    other.join()
    report = watch.report([(t0, lag), (t0 + 10, 0.001)], top=1)
    assert re.match(r"stall \d+\.\d ms, (\d+) snapshots:", report), report
    # (a loaded machine may schedule the watch rarely: a few snapshots suffice)
    assert int(re.match(r"stall [\d.]+ ms, (\d+)", report).group(1)) >= 2, report
    assert "MainThread" in report and "spinner" in report and "spin (test_profile_tool.py" in report


@pytest.mark.slow
def test_probe_gen_host_runs_the_engine_with_the_device_stubbed():
    """tools/probe_gen_host.py: gen-ref's requests through a started engine whose device work
    is canned beams; it prints the rate and the event loop's time per request."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_gen_host.py"), "--requests",
                        "256", "--concurrency", "32"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"probe_gen_host gen-ref: ([\d,]+) requests/s closed loop \(x32\) with the "
                  r"device work stubbed; event loop CPU (\d+) us per request", p.stdout)
    assert m and int(m.group(1).replace(",", "")) > 0 and int(m.group(2)) > 0, p.stdout


@pytest.mark.slow
def test_bench_rank_interleaves_the_modes_batch_by_batch(tmp_path):
    """tools/bench_rank.py --interleave: the three engines open at once, every batch timed in
    every mode (recompute included, not every k-th), the cached modes' scores checked against
    recompute's, the same table as the mode-by-mode runs."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_rank.py"), "--spec",
                        "rank-small", "--device", "cpu", "--profile", "small", "--users", "20",
                        "--limit", "60", "--warmup-frac", "0.25", "--batch", "4",
                        "--warm-batches", "1", "--recompute-every", "3", "--interleave",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    import json
    r = json.loads(out.read_text())["4"]
    n = r["batches"]["measured"]
    assert n > 0 and r["batches"]["recompute_timed"] == n  # every measured batch, every mode
    assert all(r[m]["batches"] == n for m in ("recompute", "gpu-only", "hierarchical"))
    assert all(e < 1e-4 for e in r["max_abs_err"].values()), r["max_abs_err"]
    assert r["hierarchical"]["total_hit"] > 0
    assert "Table 1: end-to-end batch latency" in p.stdout
    assert re.search(r"interleaved: background work drained after each batch, ms a batch: "
                     r"recompute [\d.]+, gpu-only [\d.]+, hierarchical [\d.]+", p.stderr)
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_rank.py"), "--interleave",
                          "--delta"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--interleave replays whole requests" in bad.stderr


NCU_SOURCE = """\
Function Name: streamgr::kernels::trie_topk_bins::bin_hist[abi:v1,cw51](long long, long long)
99                 def bin_hist(N, k, ch, F, FM, B, scores, nodes, logp, lse, s
100                r = cuda.blockIdx.y                                          249    96     249    590434  18893888 17000000 32
125                cuda.atomic.add(ws, (r, HG + i), int64(hist[i]))             101    70     101    46426  1321155 1321155 730
    0x7f00457a7400       LDC R1, c[0x0][0x28]                                   4      4      4      4096    131072    131072
Function Name: streamgr::kernels::trie_topk_bins::bin_select[abi:v52,cw51](long long)
177                hit = gi < g0 + per and gi < gend and gm[r, gi] >= d         56     20     56     131072  4194304 4194304 32
161                d, need = ws[r, D], ws[r, NEED]                              33     10     33     82192   2630144 2630144 32
"""


def test_probe_topk_summarizes_ncu_source_pages(tmp_path):
    """tools/probe_topk.py --summarize ranks each kernel's source lines by warp-stall samples
    (rows copied from session 26's report; SASS rows and lines without counts skipped)."""
    f = tmp_path / "ncu.txt"
    f.write_text(NCU_SOURCE)
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_topk.py"), "--summarize",
                        str(f)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "bin_hist: 350 samples over 2 lines"
    assert re.match(r"\s+71\.1%\s+L 100\s+r = cuda.blockIdx.y\s+\(instructions 590434\)", lines[1])
    assert "28.9%  L 125" in lines[2]
    assert lines[3] == "bin_select: 89 samples over 2 lines"
    assert "62.9%  L 177" in lines[4] and "37.1%  L 161" in lines[5]
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_topk.py"), "s9"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "unknown shapes ['s9']" in bad.stderr


def test_probe_topk_timeline_turns_stamps_into_phases():
    """tools/probe_topk.py --timeline's summary of the stamp buffer: per kind of block (the
    clock slots it stamped), each phase in us at the rate the clock ran against the global
    timer, the launch's span from the first start to the last end, and blocks that ended on an
    unstamped path counted apart."""
    import torch
    sys.path.insert(0, str(ROOT / "tools"))
    from probe_topk import _phases

    def block(start_ns, clocks, slots, end=True):
        row = torch.zeros(16, dtype=torch.int64)
        for s, c in zip([0, *slots, 13], clocks):
            row[s] = c
        row[14] = start_ns
        row[15] = start_ns + (clocks[-1] - clocks[0]) // 2 if end else 0  # a 2 GHz clock
        return row
    # two runs: a one-block kind (phases of 2,000 and 6,000 cycles: 1 and 3 us) twice, and in
    # the second run a block whose path left no end stamp
    run1 = torch.stack([block(1_000, [10, 2_010, 8_010], [1]),
                        block(1_500, [7, 2_007, 8_007], [1])])
    run2 = torch.stack([block(1_000, [10, 2_010, 8_010], [1]),
                        block(1_200, [5, 2_005, 8_005], [1], end=False)])
    out = _phases([run1, run2])
    # run 1: from 1,000 ns to 1,500 + 4,000; run 2 has no span (a block without its end)
    assert out[0] == "  launch span (first start -> last end): median 4.50 us over 1 runs"
    assert "3 block-runs stamping [0, 1, 13] (clock 2.00 GHz); whole block median 4.00 us" in out[1]
    assert out[2] == "     0 ->  1: median   1.00 us, max   1.00"
    assert out[3] == "     1 -> 13: median   3.00 us, max   3.00"
    assert out[4] == "  1 block-runs ended on a path without an end stamp"
    assert _phases([torch.zeros(0, 16, dtype=torch.int64)]) == \
        ["  no stamps: this shape's kernels do not call stamp()"]


def test_probe_topk_timeline_spans_a_pair_of_launches():
    """--timeline's line for a pair of launches (the second's blocks stamped from
    ``STAMP_SECOND``): each launch's span and the gap between them, medians over the runs whose
    every block stamped its end; nothing for a single launch."""
    import torch
    sys.path.insert(0, str(ROOT / "tools"))
    from probe_topk import _launches

    def rows(*spans):  # (start, end) ns a block
        st = torch.zeros(len(spans), 16, dtype=torch.int64)
        for i, (a, b) in enumerate(spans):
            st[i, 14], st[i, 15] = a, b
        return st
    late = torch.tensor([False, False, True, True])
    run1 = (rows((1_000, 9_000), (1_200, 10_000), (11_500, 20_000), (11_000, 18_000)), late)
    run2 = (rows((1_000, 8_000), (1_000, 8_000), (9_000, 15_000), (9_000, 15_000)), late)
    unended = (rows((1_000, 9_000), (1_000, 0), (9_500, 12_000), (9_500, 12_000)), late)
    out = _launches([run1, run2, unended])
    # spans 9.0 and 7.0 us (median of two: torch's lower), gaps 1.0 and 1.0, seconds 9.0 and 6.0
    assert out == ["  launches: first 7.00 us, gap 1.00 us, second 6.00 us (medians over 2 runs)"]
    one = (rows((1_000, 9_000)), torch.tensor([False]))
    assert _launches([one]) == []
