"""The on-disk kernel cache (``STREAMGR_KERNEL_CACHE``): its stamp moves with every input that
shapes a kernel and with nothing else; kernels take it only where it is set, never under the
simulator; on the GPU a second process loads what the first compiled and answers the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from streamgr.kernels import kernel_cache as kc

ROOT = str(Path(__file__).resolve().parents[2])


def test_stamp_moves_with_sources_and_settings_only(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    env = {"STREAMGR_TOPK_LEVELS": "0", "HOME": "/root"}
    base = kc.stamp([a, b], env)
    assert kc.stamp([b, a], dict(env)) == base  # order of listing and of the dict: same
    assert kc.stamp([a, b], {**env, "HOME": "/elsewhere", "PATH": "/x"}) == base
    assert kc.stamp([a, b], {**env, kc.ENV: "/another/root"}) == base
    assert kc.stamp([a, b], {**env, "STREAMGR_TOPK_LEVELS": "1"}) != base
    assert kc.stamp([a, b], {**env, "STREAMGR_TOPK_OWN": "2"}) != base
    assert kc.stamp([a], env) != base
    b.write_text("y = 3\n")
    assert kc.stamp([a, b], env) != base


WIRING = textwrap.dedent("""
    import json
    from streamgr.kernels import trie_topk_numba as n, trie_topk_bins as b
    from streamgr.kernels import trie_topk_merge as m, trie_topk_one as o
    from streamgr.kernels import trie_topk_own as w, trie_topk_quad as q
    from streamgr.kernels import trie_topk_root as r, kernel_cache as kc
    ks = [r.root_select, q.quad_select, w.own_select, o.one_select, m.merge_select,
          b.bin_hist, b.bin_select]
    print(json.dumps({"kernels": [[type(k._cache).__name__, k._cache._cache_path] for k in ks],
                      "stamp": kc.current_stamp()}))
""")


def test_every_selection_kernel_takes_the_cache_where_it_is_set(tmp_path):
    """Set at import (a process of its own): each selection kernel's overloads go to
    ``<root>/<stamp>``, and nothing is written until one compiles."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT] + env.get("PYTHONPATH", "").split(os.pathsep)),
               STREAMGR_KERNEL_CACHE=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", WIRING], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    on = json.loads(p.stdout.strip().splitlines()[-1])
    assert on["kernels"] == [["KernelCache", os.path.join(str(tmp_path), on["stamp"])]] * 7
    assert not any(tmp_path.iterdir())


def test_unset_or_simulated_leaves_a_kernel_as_it_is(tmp_path, monkeypatch):
    from numba import cuda

    def k(a):
        a[0] = 1

    monkeypatch.delenv(kc.ENV, raising=False)
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    plain = kc.cached(cuda.jit(k))
    assert type(plain._cache).__name__ == "NullCache"
    monkeypatch.setenv(kc.ENV, str(tmp_path))
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    sim = cuda.jit(k)
    assert kc.cached(sim) is sim and type(sim._cache).__name__ == "NullCache"
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM")
    on = kc.cached(cuda.jit(k))
    assert type(on._cache).__name__ == "KernelCache"
    assert on._cache._cache_path == os.path.join(str(tmp_path), kc.current_stamp())


GPU_RUN = textwrap.dedent("""
    import hashlib, json, torch
    from tests.kernels.test_gpu_trie_topk import level
    from streamgr.kernels import trie_topk as tt, trie_topk_root as r
    case = level(3, 1, 8192, V=16400, seed=7)
    cap = torch.full((3,), 256, device="cuda")
    got = tt.trie_topk(*case, 256, cap, impl="numba")
    ref = tt.trie_topk_reference(*case, 256, cap)
    h = hashlib.sha256(b"".join(t.cpu().numpy().tobytes() for t in got)).hexdigest()
    print(json.dumps({"equal": all(torch.equal(a, b) for a, b in zip(got, ref)), "hash": h,
                      "hits": sum(r.root_select._cache_hits.values()),
                      "misses": sum(r.root_select._cache_misses.values())}))
""")


@pytest.mark.gpu
def test_a_second_process_loads_the_compiled_kernel(tmp_path):
    # the machine's own PYTHONPATH kept (the H200 machine's msgspec is there)
    path = os.pathsep.join([ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep))
    env = {**os.environ, "PYTHONPATH": path, "STREAMGR_KERNEL_CACHE": str(tmp_path)}
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", GPU_RUN], env=env, capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["equal"] and second["equal"]
    assert (first["hits"], first["misses"]) == (0, 1)
    assert (second["hits"], second["misses"]) == (1, 0)
    assert second["hash"] == first["hash"]
