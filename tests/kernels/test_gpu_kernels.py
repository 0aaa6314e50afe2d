"""GPU: every CUDA kernel against its torch reference (fresh random data, boundary sizes,
unaligned slices, poisoned outputs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgr.kernels import _cuda, paged_kv
from streamgr.kernels.hstu_attention import (JaggedKV, hstu_attention_jagged,
                                             hstu_attention_jagged_reference)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def test_cupy_kernels_are_used():
    x = torch.zeros(4, device=DEV)
    assert _cuda.usable(x), "CuPy is not usable here: the GPU tests would test nothing new"


@pytest.mark.parametrize("n", [1, 127, 128, 1025, 4097])
@pytest.mark.parametrize("block", [8, 13, 1024])
@pytest.mark.parametrize("offset", [0, 1])
def test_block_copy(n, block, offset):
    g = torch.Generator(device=DEV).manual_seed(n * block + offset)
    src = torch.randn(offset + (n + 3) * block, device=DEV, generator=g).to(torch.bfloat16)[offset:]
    dst = torch.full((offset + (n + 5) * block,), float("nan"), device=DEV,
                     dtype=torch.bfloat16)[offset:]  # poisoned, and unaligned for offset 1
    src_idx = torch.randperm(n + 3, device=DEV, generator=g)[:n]
    dst_idx = torch.randperm(n + 5, device=DEV, generator=g)[:n]
    ref = dst.clone()
    paged_kv.block_copy_reference(ref, src.contiguous(), dst_idx, src_idx, block)
    paged_kv.block_copy(dst, src, dst_idx, src_idx, block)
    torch.testing.assert_close(dst, ref, equal_nan=True, rtol=0, atol=0)


def store(L=3, pages=40, P=16, H=2, D=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(L, pages, 2, P, H, D, device=DEV, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("n", [1, 127, 128, 300])
def test_append_rows(n):
    """The fused append reads strided k/v views in place and skips padding entries."""
    s = store(pages=40)
    s_ref = s.clone()
    g = torch.Generator(device=DEV).manual_seed(n)
    fused = torch.randn(n + 7, 4, 2, 64, device=DEV, generator=g).to(torch.bfloat16)
    k, v = fused[:, 2], fused[:, 3]  # views of one projection, row stride 4 * 2 * 64
    rows = torch.randperm(n + 7, device=DEV, generator=g)[:n]
    slots = torch.randperm(40 * 16, device=DEV, generator=g)[:n]
    page, off = slots // 16, slots % 16
    page[1::5] = -1  # padding entries
    paged_kv.append_rows(s, 1, k, v, rows, page, off)
    paged_kv.append_rows_reference(s_ref, 1, k, v, rows, page, off)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert not torch.equal(s[1], store(pages=40)[1])  # something was written


@pytest.mark.parametrize("n_chunks", [1, 3, 17])
def test_onload_scatter_and_offload_gather(n_chunks):
    L, pages, P, k = 3, 80, 16, 4
    s = store(L, pages, P)
    g = torch.Generator(device=DEV).manual_seed(n_chunks)
    buf = torch.randn(n_chunks, L, k, 2, P, 2, 64, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.randperm(pages, device=DEV, generator=g)[:n_chunks * k]
    ref = s.clone()
    for layer in range(L):
        ref[layer].index_copy_(0, ids, buf[:, layer].reshape(-1, 2, P, 2, 64))
        paged_kv.onload_scatter(s, layer, buf, ids)
    torch.testing.assert_close(s, ref, rtol=0, atol=0)
    out = torch.full_like(buf, float("nan"))
    paged_kv.offload_gather(s, ids, k, out=out)
    torch.testing.assert_close(out, buf, rtol=0, atol=0)  # the round trip gives the chunks back


def attention_case(users, H, D, P=16, seed=0):
    """users: (hist, new, cand, paged). History K/V of paged users are put in pages."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, device=DEV, generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    n_pages = sum(-(-h // P) for h, _, _, p in users if p) + 1
    st = rnd(1, n_pages, 2, P, H, D)
    q_off, kv_rows, pages, qs, ks, vs = [0], [], [], [], [], []
    free = list(torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed)).tolist())
    for hist, new, cand, paged in users:
        rows = new + cand
        qs.append(rnd(rows, H, D)), ks.append(rnd(rows, H, D)), vs.append(rnd(rows, H, D))
        kv_rows.append(q_off[-1])
        if paged:  # the whole history in pages (the new tokens were appended there too)
            pl = [free.pop() for _ in range(-(-hist // P))]
            pages.append(pl)
            hk, hv = rnd(hist, H, D), rnd(hist, H, D)
            hk[hist - new:], hv[hist - new:] = ks[-1][:new], vs[-1][:new]
            pos = torch.arange(hist)
            pi = torch.tensor(pl, dtype=torch.long)[pos // P].to(DEV)
            st[0][pi, 0, (pos % P).to(DEV)] = hk
            st[0][pi, 1, (pos % P).to(DEV)] = hv
        else:
            assert new == hist
            pages.append([])
        q_off.append(q_off[-1] + rows)
    desc = JaggedKV(q_off, [c for _, _, c, _ in users], [h for h, _, _, _ in users],
                    [p for *_, p in users], kv_rows, pages, P, st)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), desc


CASES = [
    [(5, 5, 3, False)],
    [(1, 1, 1, False), (63, 63, 2, False), (64, 64, 1, False), (65, 65, 64, False)],
    [(1025, 1025, 7, False), (300, 300, 0, False)],
    [(128, 3, 5, True), (1025, 1, 256, True), (40, 40, 2, False), (0, 0, 3, True)],
    [(4097, 17, 130, True), (127, 127, 1, True)],
]


def check_attention(q, k, v, desc, D, plan, rtol=2e-2):
    alpha, n = 1.0 / np.sqrt(D), 4096
    ref = hstu_attention_jagged_reference(q.float(), k.float(), v.float(), desc_fp32(desc), 0,
                                          alpha, n)
    out = torch.full(q.shape, float("nan"), device=DEV, dtype=q.dtype)  # poisoned
    hstu_attention_jagged(q, k, v, desc, 0, alpha, n, out=out, plan=plan)
    assert not out.isnan().any(), "rows left unwritten"
    # bf16 P and V: error relative to each row's scale (rows over few keys are tiny)
    row_scale = ref.abs().amax(dim=(1, 2), keepdim=True) + 1e-12
    torch.testing.assert_close(out.float() / row_scale, ref / row_scale, rtol=rtol, atol=rtol)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    return out


# The wgmma kernel where it runs (Hopper, compute capability 9.0); the mma.sync one everywhere.
KERNELS = ["mma"] + (["wgmma", "auto"] if torch.cuda.is_available()
                     and torch.cuda.get_device_capability() == (9, 0) else [])


@pytest.fixture(params=KERNELS)
def hstu_kernel(request, monkeypatch):
    """Both forward kernels: the wgmma one (sm_90a), the mma.sync one, and the default choice
    between them per plan."""
    from streamgr.kernels import _cuda, hstu_attention_cuda as hc
    if request.param != "mma":
        _cuda.arch_module(hc.WG_SRC, hc.WG_EXPRS, "sm_90a", hc.WG_DEFINES)  # builds
    monkeypatch.setattr(hc, "_kernel_choice", lambda index: request.param)
    return request.param


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("plan", [None, "split", "direct", "wmma"])
def test_hstu_attention_kernel(D, case, plan, hstu_kernel):
    q, k, v, desc = attention_case(CASES[case], H=2, D=D, seed=case * 7 + D)
    check_attention(q, k, v, desc, D, plan)


def strided(q, k, v):
    """q, k, v as views of one fused [rows, 3 * H * D] projection, shifted by one row."""
    rows, H, D = q.shape
    fused = torch.empty(rows + 1, 3, H, D, device=DEV, dtype=q.dtype)[1:]
    fused[:, 0], fused[:, 1], fused[:, 2] = q, k, v
    return fused[:, 0], fused[:, 1], fused[:, 2]


def random_users(rng):
    """1-16 users (hist, new, cand, paged): histories up to 20,000, pages of 1-128 keys partly
    filled, zero new tokens, one candidate; and the page size."""
    users = []
    for _ in range(int(rng.integers(1, 17))):
        hist = int(rng.choice([0, 1, int(rng.integers(1, 600)), int(rng.integers(600, 20000))]))
        paged = bool(rng.integers(0, 2)) and hist > 0
        new = int(rng.integers(0, min(hist, 40) + 1)) if paged else hist
        users.append((hist, new, int(rng.choice([0, 1, int(rng.integers(1, 300))])), paged))
    if all(n + c == 0 for _, n, c, _ in users):  # no query rows at all (a paged history with
        users.append((3, 3, 1, False))            # no new tokens or candidates has none)
    P = int(rng.choice([1, 4, 16, 24, 32, 128]))  # page index by shift (powers of two) or division
    return users, P


@pytest.mark.parametrize("seed", range(6))
def test_hstu_attention_random_jagged(seed, hstu_kernel):
    """Random batches (1-16 users, histories up to 20,000, pages of 1-128 keys partly filled,
    zero new tokens, one candidate): split and direct plans within tolerance of the reference
    and equal to each other bit for bit (a cached batch must equal its recompute), strided
    inputs read in place."""
    rng = np.random.default_rng(seed + 100 * int(torch.randint(0, 1000, ()).item()))
    D = [32, 64, 128][seed % 3]
    users, P = random_users(rng)
    q, k, v, desc = attention_case(users, H=2, D=D, P=P, seed=seed)
    try:  # a random case that fails names itself (to be replayed)
        outs = [check_attention(*strided(q, k, v), desc, D, plan) for plan in ("split", "direct")]
        assert torch.equal(outs[0], outs[1]), "split and direct plans differ"
    except AssertionError as err:
        raise AssertionError(f"{err}\ncase: users={users} D={D} P={P}") from None


@pytest.mark.skipif("wgmma" not in KERNELS, reason="the wgmma kernel needs an sm_90 GPU")
@pytest.mark.parametrize("seed", range(9))
def test_mma_and_wgmma_kernels_give_the_same_bits(seed, monkeypatch):
    """The default (``auto``) runs a cached batch's split plan on the mma.sync kernel and a
    recompute's direct plan on the wgmma one, so a cached batch equals its recompute bit for
    bit only if the two kernels agree bit for bit: random batches, both plans on both kernels
    (mma.sync with its tiles with tails), all four outputs equal."""
    from streamgr.kernels import hstu_attention_cuda as hc
    rng = np.random.default_rng(seed + 100 * int(torch.randint(0, 1000, ()).item()))
    D = [32, 64, 128][seed % 3]
    users, P = random_users(rng)
    q, k, v, desc = attention_case(users, H=2, D=D, P=P, seed=seed)
    outs = {}
    for kern in ("mma", "wgmma"):
        monkeypatch.setattr(hc, "_kernel_choice", lambda index, c=kern: c)
        desc._cache.clear()  # its plans: tiles with tails on mma.sync only
        for plan in ("split", "direct"):
            outs[kern, plan] = check_attention(*strided(q, k, v), desc, D, plan)
    for key, out in outs.items():
        assert torch.equal(out, outs["mma", "split"]), (key, f"users={users} D={D} P={P}")


@pytest.mark.parametrize("seed", range(3))
def test_tiles_with_tails_give_the_same_bits(seed, monkeypatch):
    """Tiles with tails (STREAMGR_HSTU_TAIL=1: a user's last <= 16 rows run on the preceding
    tile's K/V tiles by all four warps) against separate tail tiles: split and direct plans of
    both within tolerance of the reference and all four equal bit for bit (mma.sync kernel)."""
    from streamgr.kernels import hstu_attention_cuda as hc
    monkeypatch.setattr(hc, "_kernel_choice", lambda index: "mma")
    rng = np.random.default_rng(seed)
    D = [64, 128, 128][seed]
    users = [(int(rng.integers(300, 9000)), int(rng.integers(0, 17)), 256, True)
             for _ in range(int(rng.integers(1, 6)))]
    users += [(5000, 0, 256, True), (3000, 16, 256, True), (3000, 17, 256, True),
              (129, 129, 1, False), (144, 144, 0, False), (145, 145, 0, False)]
    outs = []
    for tails in (False, True):
        monkeypatch.setattr(hc, "TAILS", tails)
        q, k, v, desc = attention_case(users, H=2, D=D, P=32, seed=seed)
        for plan in ("split", "direct"):
            outs.append(check_attention(*strided(q, k, v), desc, D, plan))
            assert desc.cuda_plan(DEV, 2, plan, D).max_rows == (hc.SR if tails else hc.BM)
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "tails changed the bits"


def desc_fp32(desc: JaggedKV) -> JaggedKV:
    return JaggedKV(desc.q_offsets, desc.num_candidates, desc.hist_lens, desc.paged,
                    desc.kv_rows, desc.pages, desc.page_tokens, desc.store.float())


@pytest.mark.parametrize("seed", range(3))
def test_candidate_only_plan_gives_the_candidates_the_same_bits(seed):
    """The last layer's plan (``cand_only``: the row tiles that hold a candidate) leaves the
    candidates' rows bit for bit as the full plan computes them, split and direct, and leaves
    the rows of the tiles it drops unwritten."""
    rng = np.random.default_rng(seed)
    D = [64, 128, 128][seed]
    users = [(h, h, int(rng.integers(1, 300)), False)
             for h in rng.integers(1, 3000, int(rng.integers(1, 6)))]
    users += [(4000, 4000, 256, False), (300, 5, 256, True), (127, 127, 1, False)]
    q, k, v, desc = attention_case(users, H=2, D=D, P=32, seed=seed)
    alpha, n = 1.0 / np.sqrt(D), 4096
    cand = torch.cat([torch.arange(desc.q_offsets[b + 1] - c, desc.q_offsets[b + 1])
                      for b, c in enumerate(desc.num_candidates)]).to(DEV)
    for plan in ("split", "direct"):
        full = check_attention(*strided(q, k, v), desc, D, plan)
        out = torch.full(q.shape, float("nan"), device=DEV, dtype=q.dtype)
        hstu_attention_jagged(*strided(q, k, v), desc, 0, alpha, n, out=out, plan=plan,
                              cand_only=True)
        assert torch.equal(out[cand], full[cand]), plan
        assert out.isnan().any(), "no history tile was dropped"


@pytest.mark.parametrize("T,N,M", [(1, 512, 512), (37, 64, 96), (2088, 512, 512)])
def test_fused_layer_end_matches_the_reference(T, N, M):
    """hstu_norm_mul + addmm (x + W_o (LayerNorm(attn) * u) + b_o) against torch's unfused
    ops: y within a bf16 rounding of the reference's, the layer's output within bf16 tolerance,
    u read in place from a strided projection."""
    from torch import nn
    from streamgr.kernels import hstu_glue
    g = torch.Generator(device=DEV).manual_seed(T)
    rnd = lambda *s: torch.randn(*s, device=DEV, generator=g).to(torch.bfloat16)  # noqa: E731
    norm = nn.LayerNorm(N, eps=1e-6).to(DEV, torch.bfloat16)
    out = nn.Linear(N, M).to(DEV, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * rnd(N)), norm.bias.copy_(0.1 * rnd(N))
    x, attn = rnd(T, M), rnd(T, N) * 3 + 1
    u = rnd(T, 4 * N)[:, N:2 * N]  # a column block of a [T, 4N] projection
    assert hstu_glue.fused_ok(x, attn, u, norm, out)
    with torch.no_grad():
        y, xb = hstu_glue.norm_mul(x, attn, u, norm, out.bias)
        ref_y = norm(attn) * u
        torch.testing.assert_close(y.float(), ref_y.float(), rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(xb, x + out.bias, rtol=0, atol=0)
        got = hstu_glue.finish(x, attn, u, norm, out)
        ref = hstu_glue.finish_reference(x.float(), attn.float(), u.float(), norm.float(),
                                         out.float())
    assert got.dtype == torch.bfloat16 and got.shape == (T, M)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
