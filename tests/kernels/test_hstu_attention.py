"""The jagged HSTU attention against a plain dense per-user reference written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamgr.errors import StreamgrError
from streamgr.kernels import hstu_attention as mod


def dense_reference(q, k, v, hist, new, cand, alpha, n):
    """One user, float64, an explicit [queries, keys] mask."""
    q, k, v = q.double(), k.double(), v.double()
    start = hist - new
    mask = torch.zeros(new + cand, hist + cand, dtype=torch.bool)
    for i in range(new):
        mask[i, : start + i + 1] = True
    for c in range(cand):
        mask[new + c, :hist] = True
        mask[new + c, hist + c] = True
    s = torch.einsum("qhd,khd->hqk", q, k)
    a = F.silu(alpha * s) * mask / n
    return torch.einsum("hqk,khd->qhd", a, v)


def make_layout(users, heads, d, dv, gen, dtype=torch.float32):
    """users: list of (hist, new, cand). Keys hold the whole history + candidates; queries the
    last `new` history tokens + candidates (the cached-prefix layout; new == hist is recompute)."""
    q_off, kv_off, qs, ks, vs = [0], [0], [], [], []
    for hist, new, cand in users:
        kk = torch.randn(hist + cand, heads, d, generator=gen, dtype=dtype)
        vv = torch.randn(hist + cand, heads, dv, generator=gen, dtype=dtype)
        qq = torch.randn(new + cand, heads, d, generator=gen, dtype=dtype)
        qs.append(qq), ks.append(kk), vs.append(vv)
        q_off.append(q_off[-1] + new + cand)
        kv_off.append(kv_off[-1] + hist + cand)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), q_off, kv_off


@pytest.mark.parametrize("users", [
    [(5, 5, 3)],                                   # recompute, one user
    [(1, 1, 1), (37, 37, 4), (200, 200, 16)],      # recompute, jagged
    [(64, 7, 2), (300, 1, 5), (10, 0, 3), (0, 0, 2)],  # cached prefixes, empty history
    [(mod.QUERY_TILE + 3, mod.QUERY_TILE + 1, 2)],  # crosses a query tile boundary
])
def test_jagged_equals_dense(users):
    gen = torch.Generator().manual_seed(hash(tuple(users)) % 2**31)
    heads, d, dv, alpha, n = 2, 16, 8, 0.25, 4096
    q, k, v, q_off, kv_off = make_layout(users, heads, d, dv, gen)
    cands = [c for _, _, c in users]
    out = torch.full((q.shape[0], heads, dv), float("nan"))  # poisoned: every row must be written
    mod.hstu_attention_reference(q, k, v, q_off, kv_off, cands, alpha, n, out=out)
    for b, (hist, new, cand) in enumerate(users):
        ref = dense_reference(q[q_off[b]:q_off[b + 1]], k[kv_off[b]:kv_off[b + 1]],
                              v[kv_off[b]:kv_off[b + 1]], hist, new, cand, alpha, n)
        torch.testing.assert_close(out[q_off[b]:q_off[b + 1]].double(), ref, rtol=1e-5, atol=1e-8)


def test_unaligned_views():
    """Inputs that are offset views of larger buffers (not starting at element 0)."""
    gen = torch.Generator().manual_seed(7)
    users = [(33, 33, 3), (17, 4, 2)]
    q, k, v, q_off, kv_off = make_layout(users, 2, 8, 8, gen)
    pad = lambda t: torch.cat([torch.randn(1, *t.shape[1:], generator=gen), t])[1:]
    a = mod.hstu_attention_reference(q, k, v, q_off, kv_off, [3, 2], 0.5, 100)
    b = mod.hstu_attention_reference(pad(q), pad(k), pad(v), q_off, kv_off, [3, 2], 0.5, 100)
    torch.testing.assert_close(a, b)


def test_candidates_do_not_see_each_other():
    gen = torch.Generator().manual_seed(3)
    q, k, v, q_off, kv_off = make_layout([(20, 20, 4)], 2, 8, 8, gen)
    base = mod.hstu_attention_reference(q, k, v, q_off, kv_off, [4], 0.5, 64)
    k2, v2 = k.clone(), v.clone()
    k2[21], v2[21] = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)  # candidate 1
    out = mod.hstu_attention_reference(q, k2, v2, q_off, kv_off, [4], 0.5, 64)
    changed = (out - base).abs().amax(dim=(1, 2)) > 0
    assert changed.tolist() == [False] * 21 + [True] + [False] * 2


@pytest.mark.parametrize("bad", ["offsets", "layout", "shape"])
def test_bad_layout_is_a_clear_error(bad):
    gen = torch.Generator().manual_seed(1)
    q, k, v, q_off, kv_off = make_layout([(4, 4, 2)], 1, 4, 4, gen)
    args = dict(q=q, k=k, v=v, q_offsets=q_off, kv_offsets=kv_off, num_candidates=[2])
    if bad == "offsets":
        args["q_offsets"] = [0, 5]
    elif bad == "layout":
        args["num_candidates"] = [7]
    else:
        args["k"] = k[:, :, :2]
    with pytest.raises(StreamgrError):
        mod.hstu_attention_reference(alpha=1.0, max_len=8, **args)


def plan_case(users):
    """A batch layout (no tensors) from ``(hist, new, cand, paged)`` per user, pages of 32."""
    q_off = [0]
    for h, n, c, _ in users:
        q_off.append(q_off[-1] + n + c)
    return mod.JaggedKV(q_off, [u[2] for u in users], [u[0] for u in users],
                        [u[3] for u in users], q_off[:-1],
                        [list(range(-(-u[0] // 32))) if u[3] else [] for u in users], 32, None)


@pytest.mark.parametrize("force", ["split", "direct"])
def test_padded_plan_adds_only_work_that_writes_nothing(force):
    """A captured rank plan's work items are padded to a capacity: padding items and merge rows
    belong to the empty user (index = capacity's users), key ranges are empty, the page table's
    tail repeats its end, and every slot of the buffer is written."""
    import numpy as np
    from streamgr.kernels import hstu_plan as hplan
    users = [(700, 5, 30, True), (40, 40, 3, False), (0, 0, 2, True)]
    desc = plan_case(users)
    hp = hplan.plan_host(desc, heads=2, force=force)
    cap = hplan.Capacity(items=64, users=8, pages=64, fin=16, slots=64)
    out = np.full(sum(cap.sizes), -99, np.int32)
    hplan.pad_plan(hp, cap, out)
    assert not (out == -99).any()
    v = np.split(out, np.cumsum(cap.sizes)[:-1])
    n, f = len(hp.items[0]), len(hp.fin[0])
    assert (v[0][:n] == hp.items[0]).all() and (v[0][n:] == cap.users).all()  # item users
    assert (v[2][n:] == 0).all() and (v[3][n:] == 0).all()  # no key tiles
    for i in range(6):  # per-user arrays, the empty user's entries zero
        assert (v[5 + i][:3] == hp.users[i]).all() and (v[5 + i][3:] == 0).all()
    assert (v[11][:4] == hp.page_ptr).all() and (v[11][4:] == hp.page_ptr[-1]).all()
    assert (v[13][f:] == cap.users).all() and (v[16][f:] == 0).all()  # merge rows, no slots


@pytest.mark.parametrize("name,fn,good,bad", [
    ("STREAMGR_HSTU_TILE", "hstu_plan._tile_config", "32x3x32",
     ["64x2", "64x2x128", "16x2x16", "ax2x32"]),
    ("STREAMGR_HSTU_KC", "hstu_plan._chunk_keys", "1024", ["768", "0", "512x2", ""]),
    ("STREAMGR_HSTU_TAIL", "hstu_plan._tails", "0", ["2", "yes", "1x1"]),
    ("STREAMGR_HSTU_WG", "hstu_attention_cuda._wg_config", "4x1x1x0x64",
     ["2x1x1x1x64", "4x1x0x1x128", "3x0x0x1x128", "3x1x0x1", "4x1x0x2x64", "3x1x0x1x96"]),
])
def test_attention_ab_knobs_parse_or_say_what_they_expect(monkeypatch, name, fn, good, bad):
    """The A/B knobs of the attention kernels: a good value parses, a bad one is a clear error
    naming the variable (never a silent default)."""
    import importlib
    module, fn = fn.split(".")
    m = importlib.import_module(f"streamgr.kernels.{module}")
    monkeypatch.setenv(name, good)
    want = tuple(int(x) for x in good.split("x")) if "x" in good else int(good)
    assert getattr(m, fn)() == (bool(want) if fn == "_tails" else want)
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(StreamgrError, match=name):
            getattr(m, fn)()


@pytest.mark.parametrize("force", ["split", "direct"])
@pytest.mark.parametrize("tails", [False, True])
def test_plan_tiles_cover_every_row_once(force, tails):
    """Row tiles (with tails: a user's last <= TAIL rows past a full tile join that tile) cover
    each user's rows exactly once under the kernels' row rule, with one tile fewer exactly
    where a tail joined."""
    from streamgr.kernels import hstu_plan as hc
    users = [(6400, 5, 256, True), (6400, 0, 256, True), (700, 16, 256, True),
             (700, 17, 256, True), (40, 40, 3, False), (0, 0, 2, True), (300, 9, 128, True),
             (200, 200, 100, False)]
    desc = plan_case(users)
    hp = hc.plan_host(desc, heads=4, force=force, tails=tails)
    assert hp.max_rows == (hc.SR if tails else hc.BM)
    f_user, f_row0 = hp.fin[0], hp.fin[1]
    for b, (h, n, c, _) in enumerate(users):
        rows = n + c
        seen = []
        for r0 in sorted(f_row0[f_user == b]):
            left = rows - r0
            nrows = left if left <= hp.max_rows else hc.BM  # the kernels' tile_rows (hstu_slots.cuh)
            assert 0 < nrows <= hp.max_rows
            seen += range(r0, r0 + nrows)
        assert seen == list(range(rows)), (b, tails)
        tails_here = rows > hc.BM and 0 < rows % hc.BM <= hc.TAIL
        assert len(seen) == 0 or (len(f_row0[f_user == b]) == -(-rows // hc.BM) - (tails and tails_here))


@pytest.mark.parametrize("tails", [False, True])
def test_candidate_only_plans_cover_the_candidates_and_drop_history_tiles(tails):
    """The last layer's plan (``cand_only``) keeps exactly the row tiles that hold a candidate
    row, from the same tiling (so each candidate row's sums are the same); ``plan_host_pair``
    shares one tiling and says None when no tile would be dropped (a cached batch's)."""
    from streamgr.kernels import hstu_plan as hp_mod
    users = [(6400, 6400, 256, False), (300, 300, 1, False), (700, 5, 256, True),
             (129, 129, 2, False), (40, 40, 3, False)]
    desc = plan_case(users)
    full = hp_mod.plan_host(desc, heads=4, tails=tails)
    last = hp_mod.plan_host(desc, heads=4, tails=tails, cand_only=True)
    pair_full, pair_last = hp_mod.plan_host_pair(desc, heads=4, tails=tails)
    for a, b in ((full, pair_full), (last, pair_last)):
        assert a.split == b.split and all((x == y).all() for x, y in zip(a.fin, b.fin))
    tiles = lambda p: {(int(u), int(r)) for u, r in zip(p.fin[0], p.fin[1])}  # noqa: E731
    assert tiles(last) < tiles(full)
    for b, (h, n, c, _) in enumerate(users):
        rows, covered = n + c, set()
        for u, r0 in tiles(last):
            if u == b:
                left = rows - r0
                nrows = left if left <= last.max_rows else hp_mod.BM
                assert r0 + nrows > n, "a tile without candidates was kept"
                covered |= set(range(r0, r0 + nrows))
        assert set(range(n, rows)) <= covered, b
        dropped = {t for t in tiles(full) - tiles(last) if t[0] == b}
        assert all(r0 + hp_mod.BM <= n for _, r0 in dropped)
    cached = mod.JaggedKV([0, 261], [256], [6400], [True], [0], [list(range(200))], 32, None)
    assert hp_mod.plan_host_pair(cached, heads=4, tails=tails)[1] is None


def test_layer_end_falls_back_to_the_reference_where_the_kernel_cannot_run():
    """On the CPU (and for fp32) the layer's end is torch's unfused ops, exactly."""
    from torch import nn
    from streamgr.kernels import hstu_glue
    torch.manual_seed(0)
    norm, out = nn.LayerNorm(64, eps=1e-6), nn.Linear(64, 32)
    x, attn, u = torch.randn(5, 32), torch.randn(5, 64), torch.randn(5, 256)[:, 64:128]
    assert not hstu_glue.fused_ok(x, attn, u, norm, out)
    with torch.no_grad():
        assert torch.equal(hstu_glue.finish(x, attn, u, norm, out), x + out(norm(attn) * u))


def test_page_table_from_arrays_equals_the_one_from_lists():
    """The cached runner hands its page ids as int64 arrays, tests and other callers as lists:
    the CSR page table (and so the plan) is the same either way."""
    import numpy as np
    from streamgr.kernels import hstu_plan
    users = [(700, 5, 30, True), (40, 40, 3, False), (0, 0, 2, True), (65, 1, 4, True)]
    lists = plan_case(users)
    arrays = plan_case(users)
    arrays.pages = [np.asarray(p, dtype=np.int64) for p in arrays.pages]
    for a, b in zip(hstu_plan.page_csr(lists), hstu_plan.page_csr(arrays)):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)
    pa, pb = hstu_plan.plan_host(lists, heads=2), hstu_plan.plan_host(arrays, heads=2)
    assert np.array_equal(pa.items, pb.items) and np.array_equal(pa.fin, pb.fin)


def _random_desc(rng):
    users = []
    for _ in range(int(rng.integers(1, 17))):
        hist = int(rng.choice([0, 1, 7, 130, 700, 6400, 20000]) + rng.integers(0, 300))
        paged = bool(rng.random() < 0.7)
        new = int(rng.integers(0, 40)) if paged else hist
        cand = int(rng.choice([0, 1, 3, 127, 128, 129, 256]))
        users.append((max(hist, new), new, cand, paged))
    return plan_case(users)


@pytest.mark.parametrize("seed", range(12))
def test_compiled_planner_equals_the_numpy_reference(seed):
    """The Numba-compiled planning (what serves) gives the numpy reference's plans item for
    item, in the same order, and the same padded buffer, on random jagged batches (1-16 users,
    histories 0 to ~20,000 tokens, zero to 256 candidates, paged or not): every force and tails
    setting, candidate-only plans, and pairs."""
    import numpy as np
    from streamgr.kernels import hstu_plan as hp_mod
    assert hp_mod._jit() is not None, "numba should be importable wherever the tests run"
    rng = np.random.default_rng(seed)
    for _ in range(6):
        desc = _random_desc(rng)
        heads, sms = int(rng.choice([1, 2, 4, 8])), int(rng.choice([4, 132]))
        pairs = []
        for tails in (False, True):
            for force in (None, "split", "direct"):
                for cand_only in (False, True):
                    pairs.append((hp_mod.plan_host(desc, heads, sms, force, tails, cand_only),
                                  hp_mod.plan_host_reference(desc, heads, sms, force, tails,
                                                             cand_only)))
            got, want = (hp_mod.plan_host_pair(desc, heads, sms, tails),
                         hp_mod.plan_host_pair_reference(desc, heads, sms, tails))
            assert (got[1] is None) == (want[1] is None)
            pairs += [(got[0], want[0])] + ([(got[1], want[1])] if got[1] is not None else [])
        for a, b in pairs:
            assert a.split == b.split and a.n_slots == b.n_slots and a.max_rows == b.max_rows
            for name in ("items", "users", "page_ptr", "pages", "fin"):
                x, y = getattr(a, name), getattr(b, name)
                assert x.shape == y.shape and (x == y).all(), name
            cap = hp_mod.Capacity(items=a.items.shape[1] + int(rng.integers(0, 9)), users=16,
                                  pages=len(a.pages) + int(rng.integers(0, 9)),
                                  fin=a.fin.shape[1] + int(rng.integers(0, 5)),
                                  slots=a.n_slots + 1)
            out_a = np.full(sum(cap.sizes), -7, np.int32)
            out_b = out_a.copy()
            hp_mod.pad_plan(a, cap, out_a)
            hp_mod.pad_plan_reference(b, cap, out_b)
            assert (out_a == out_b).all() and not (out_a == -7).any()
    small = hp_mod.Capacity(items=0, users=16, pages=1, fin=0, slots=1)
    hp = hp_mod.plan_host(_random_desc(np.random.default_rng(seed + 100)), 2)
    if hp.items.shape[1]:
        with pytest.raises(ValueError, match="capacity"):
            hp_mod.pad_plan(hp, small, np.zeros(sum(small.sizes) + 10**6, np.int32))


def _choice(monkeypatch, env, build_error=None):
    """``_kernel_choice`` on a pretend Hopper GPU (no GPU needed), the wgmma build faked."""
    from streamgr.kernels import _cuda, hstu_attention_cuda as hc

    def build(*a, **k):
        if build_error is not None:
            raise build_error
    monkeypatch.setenv("STREAMGR_HSTU_KERNEL", env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(_cuda, "arch_module", build)
    hc._kernel_choice.cache_clear()
    try:
        return hc._kernel_choice(0)
    finally:
        hc._kernel_choice.cache_clear()


def test_kernel_choice_auto_falls_back_to_mma_when_wgmma_cannot_build(monkeypatch):
    """``auto`` (the default) on a Hopper GPU is wgmma for direct plans; where the wgmma module
    cannot build (an older CuPy, NVRTC) it serves every plan on mma.sync instead of failing,
    while an explicit ``wgmma`` says why it cannot run; a bad value is a clear error."""
    assert _choice(monkeypatch, "auto") == "auto"
    assert _choice(monkeypatch, "mma") == "mma"
    assert _choice(monkeypatch, "auto", StreamgrError("no NVRTC hook")) == "mma"
    with pytest.raises(StreamgrError, match="no NVRTC hook"):
        _choice(monkeypatch, "wgmma", StreamgrError("no NVRTC hook"))
    with pytest.raises(StreamgrError, match="STREAMGR_HSTU_KERNEL"):
        _choice(monkeypatch, "fast")


@pytest.mark.parametrize("choice", ["auto", "mma"])
def test_auto_tiles_a_direct_plan_without_tails_for_wgmma(monkeypatch, choice):
    """With ``auto`` a recompute's direct plan is tiled without tails (the wgmma kernel runs
    it; a user's last <= 16 rows take a tile of their own) and runs on wgmma; a cached batch's
    split plan keeps its tails and runs on mma.sync. With ``mma`` both keep tails."""
    from streamgr.kernels import hstu_attention_cuda as hc
    monkeypatch.setattr(hc, "TAILS", True)  # the default (STREAMGR_HSTU_TAIL=0 turns it off)
    monkeypatch.setattr(hc, "_kernel_choice", lambda index: choice)
    dev = torch.device("cuda")  # a device object only: nothing runs
    recompute = plan_case([(6400, 6400, 10, False)] * 8)  # rows % 128 = 10: a tail each
    cached = plan_case([(6400, 5, 256, True), (9000, 0, 140, True)])
    full, last = hc.plan_pair(recompute, dev, heads=4, dim=128, sms=132)
    assert not full.split
    assert full.max_rows == (hc.BM if choice == "auto" else hc.SR)
    assert all(p is None or p.max_rows == full.max_rows for p in (last,))
    plan = hc.Plan(full.split, 1, 1, 1, [], [], {}, full.max_rows)
    assert hc._wgmma_runs(plan, 0, 128) == (choice == "auto")
    assert not hc._wgmma_runs(plan, 0, 32)  # D = 32: mma.sync under auto
    split, _ = hc.plan_pair(cached, dev, heads=4, dim=128, sms=132)
    assert split.split and split.max_rows == hc.SR
    assert not hc._wgmma_runs(hc.Plan(True, 1, 1, 1, [], [], {}, split.max_rows), 0, 128)
