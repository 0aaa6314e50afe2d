"""tools/bench_generate.py runs end to end on the CPU (gen-small): the closed and open loops,
the header naming the widths actually served, and Hugging Face skipped cleanly at
``--hf-requests 0`` (no model built, no agreement over nothing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_generate_with_a_beam_width_and_no_hugging_face(tmp_path):
    out = tmp_path / "gen.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_generate.py"), "--spec",
                        "gen-small", "--device", "cpu", "--requests", "12", "--concurrency", "4",
                        "--rates", "400", "--hf-requests", "0", "--beam-width", "8",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "RuntimeWarning" not in p.stderr, p.stderr[-2000:]
    assert "beam widths [8, 8, 8]," in p.stdout, p.stdout  # not the policy's [16, 32, 32]
    assert "top-k agreement with Hugging Face: skipped (--hf-requests 0)" in p.stdout
    assert "hugging face (bs 1)" not in p.stdout
    assert re.search(r"^bench_generate gen-small: [\d.]+ req/s closed-loop; open loop", p.stdout,
                     re.M), p.stdout
    fig = json.loads(out.read_text())
    assert fig["agreement"] is None and fig["hf_rps"] == 0.0
    assert [r["mode"] for r in fig["runs"]] == ["closed", "open"]
    assert all(r["errors"] == 0 for r in fig["runs"])
    assert all(r["throughput"] > 0 for r in fig["runs"])
