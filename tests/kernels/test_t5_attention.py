"""The T5 encoder's attention with the bias inside: the torch reference against the dense-bias
expression it replaces (CPU), and the CUDA kernel against the reference on the GPU (random
shapes, boundary lengths, padding, strided views of one fused projection, graph replays, and a
whole encoder against the cuDNN dense-bias path)."""

from __future__ import annotations

import pytest
import torch

from streamgr.errors import StreamgrError
from streamgr.kernels import t5_attention as ta
from streamgr.kernels.encoder_bias import encoder_bias_reference


def _inputs(R, S, H, d, seed, device="cpu", dtype=torch.float32, fused=False):
    g = torch.Generator().manual_seed(seed)
    if fused:  # q, k, v as views of one [R, S, 3, H, d] projection (strided rows)
        qkv = torch.randn(R, S, 3, H, d, generator=g).to(device=device, dtype=dtype)
        q, k, v = qkv.unbind(2)
    else:
        q, k, v = (torch.randn(R, S, H, d, generator=g).to(device=device, dtype=dtype)
                   for _ in range(3))
    table = (torch.randn(H, 2 * S - 1, generator=g) * 2).to(device)
    lens = torch.randint(1, S + 1, (R,), generator=g)
    lens[0] = S  # one request without padding
    keep = (torch.arange(S)[None, :] < lens[:, None]).to(device)
    return q, k, v, table, keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_softmax_over_the_dense_bias(dtype):
    """The same numbers as attention over ``encoder_bias_reference``'s dense bias (the path
    the kernel replaces): real rows equal within fp32 rounding."""
    R, S, H, d = 3, 9, 2, 8
    q, k, v, table, keep = _inputs(R, S, H, d, 0, dtype=dtype)
    got = ta.encoder_attention_reference(q, k, v, table, keep)
    bias = encoder_bias_reference(table, keep, dtype).float()  # [R, H, S, S]
    s = torch.einsum("rihd,rjhd->rhij", q.float(), k.float()) + bias
    want = torch.einsum("rhij,rjhd->rihd", torch.softmax(s, -1), v.float()).to(dtype)
    assert got.shape == (R, S, H, d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)
    assert ta.encoder_attention(q, k, v, table, keep).equal(got)  # the CPU takes the reference


def test_bad_shapes_are_refused():
    q, k, v, table, keep = _inputs(2, 8, 2, 8, 1)
    with pytest.raises(StreamgrError, match="table"):
        ta.encoder_attention(q, k, v, table[:, :-1], keep)
    with pytest.raises(StreamgrError, match="alike"):
        ta.encoder_attention(q, k[:, :-1], v, table, keep)
    with pytest.raises(StreamgrError, match="out must be"):
        ta.encoder_attention(q, k, v, table, keep, out=torch.empty(2, 8, 2, 4))
    out = torch.empty_like(q)  # a destination of the right shape takes the answer
    assert ta.encoder_attention(q, k, v, table, keep, out=out) is out
    assert out.equal(ta.encoder_attention_reference(q, k, v, table, keep))


@pytest.mark.gpu
def test_long_contexts_leave_the_kernel_to_the_dense_path():
    """Past what the kernel's shared memory holds (~18,600 positions) the model keeps the
    dense bias (cuDNN)."""
    x = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    assert ta.smem_bytes(784, 64) < ta._SMEM_MAX < ta.smem_bytes(30_000, 64)
    assert ta.kernel_applies(x, 64, 784) and not ta.kernel_applies(x, 64, 30_000)
    assert not ta.kernel_applies(x, 128, 784)  # head dims 32 and 64 only


def _close(got, want):
    scale = want.float().abs().amax() + 1e-6
    err = ((got.float() - want.float()).abs() / scale).amax().item()
    assert err < 2e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("R,S,H,d,fused", [
    (1, 1, 1, 64, False), (2, 5, 3, 32, False), (3, 64, 2, 64, True), (2, 127, 4, 64, False),
    (2, 128, 2, 32, True), (4, 200, 8, 64, False), (32, 784, 8, 64, True), (1, 1000, 1, 64, False)])
def test_kernel_matches_reference(R, S, H, d, fused):
    q, k, v, table, keep = _inputs(R, S, H, d, R * S + d, "cuda", torch.bfloat16, fused)
    assert ta.kernel_applies(q, d, S)
    got = ta.encoder_attention(q, k, v, table, keep)
    want = ta.encoder_attention_reference(q, k, v, table, keep)
    assert got.shape == want.shape and got.is_contiguous() and not got.isnan().any()
    _close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
@pytest.mark.parametrize("R,S,H,fused", [
    (1, 1, 1, False), (2, 63, 2, True), (2, 64, 3, False), (3, 65, 2, False), (2, 128, 2, True),
    (2, 129, 1, False), (1, 256, 2, False), (4, 300, 8, True), (32, 784, 8, True),
    (1, 2000, 2, False)])
def test_both_kernels_match_the_reference(monkeypatch, kernel, R, S, H, fused):
    """Head dim 64 on each kernel (mma.sync and the sm_90a wgmma one), tile boundaries of
    both (64- and 128-key tiles, 128 query rows, one consumer warpgroup with rows or two)."""
    monkeypatch.setattr(ta, "KERNEL", kernel)
    q, k, v, table, keep = _inputs(R, S, H, 64, 11 * S + R, "cuda", torch.bfloat16, fused)
    if kernel == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(StreamgrError, match="needs an sm_90 GPU"):  # refused, not faked
            ta.encoder_attention(q, k, v, table, keep)
        return
    for mask in ("prefix", "scattered"):
        if mask == "scattered":  # masked keys anywhere (tiles of real keys beside masked ones)
            g = torch.Generator().manual_seed(S)
            keep = (torch.rand(R, S, generator=g) < 0.9).to("cuda")
            keep[:, :min(S, 130)] = True
            if R > 1:
                keep[-1] = False  # a request without a real key: zeros
        got = ta.encoder_attention(q, k, v, table, keep)
        want = ta.encoder_attention_reference(q, k, v, table, keep)
        assert not got.isnan().any(), mask
        _close(got, want)


@pytest.mark.gpu
def test_wgmma_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.setattr(ta, "KERNEL", "wgmma")
    q, k, v, table, keep = _inputs(2, 40, 2, 32, 3, "cuda", torch.bfloat16)
    with pytest.raises(StreamgrError, match="head dim 64"):
        ta.encoder_attention(q, k, v, table, keep)
    monkeypatch.setattr(ta, "KERNEL", "fastest")
    with pytest.raises(StreamgrError, match="auto, mma or wgmma"):
        ta.encoder_attention(q, k, v, table, keep)


@pytest.mark.gpu
def test_kernel_replays_from_a_cuda_graph():
    q, k, v, table, keep = _inputs(4, 100, 2, 64, 7, "cuda", torch.bfloat16)
    out = ta.encoder_attention(q, k, v, table, keep)  # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ta.encoder_attention(q, k, v, table, keep)
    q.normal_()
    keep[1, 50:] = False
    g.replay()
    torch.cuda.synchronize()
    _close(out, ta.encoder_attention_reference(q, k, v, table, keep))


@pytest.mark.gpu
def test_encoder_with_the_kernel_matches_the_dense_bias_path(monkeypatch):
    """A random bf16 T5's encoder output with the kernel and with cuDNN's dense bias."""
    from streamgr.models.t5 import T5, T5Config
    cfg = T5Config(vocab_size=300, d_model=128, d_kv=64, d_ff=256, num_layers=2,
                   num_decoder_layers=1, num_heads=2)
    model = T5(cfg).init_random(3).to("cuda", torch.bfloat16).eval()
    tokens = torch.randint(1, 300, (3, 96), device="cuda")
    mask = torch.ones(3, 96, dtype=torch.bool, device="cuda")
    mask[1, 40:] = False
    mask[2, 95:] = False
    with_kernel = model.encode(tokens, mask)
    monkeypatch.setattr(ta, "ENABLED", False)
    dense = model.encode(tokens, mask)
    real = mask[:, :, None].expand_as(dense)
    a, b = with_kernel[real].float(), dense[real].float()
    # Two bf16 paths through two layers and a norm (P rounded to bf16 in one, not in the
    # other): close in norm, and no element far off (a single layer's tolerance is tighter).
    assert ((a - b).norm() / b.norm()).item() < 1e-2
    assert ((a - b).abs().max() / b.abs().max()).item() < 5e-2


@pytest.mark.gpu
def test_unaligned_views_and_a_poisoned_out():
    """A view the kernel cannot read (rows one element off 16 bytes) takes the reference and
    gives the same answer; a NaN-poisoned destination is written everywhere."""
    q, k, v, table, keep = _inputs(3, 77, 2, 64, 5, "cuda", torch.bfloat16)
    want = ta.encoder_attention_reference(q, k, v, table, keep)
    wide = torch.zeros(3, 77, 2, 65, device="cuda", dtype=torch.bfloat16)
    wide[..., 1:] = q
    _close(ta.encoder_attention(wide[..., 1:], k, v, table, keep), want)
    out = torch.full_like(q, float("nan"))
    assert ta.encoder_attention(q, k, v, table, keep, out=out) is out
    assert not out.isnan().any()
    _close(out, want)


def _cross_inputs(R, B, S, H, seed, device="cpu", dtype=torch.float32, fused=False):
    """Cross-attention inputs: q [R, B, H, 64], k/v [R, S, H, 64] (``fused``: column slices of
    one projection of two layers' k|v, as ``t5_fuse.cross_kv`` gives them), keep [R, S]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, B, H, 64, generator=g).to(device=device, dtype=dtype)
    if fused:
        kv = torch.randn(R, S, 4 * H * 64, generator=g).to(device=device, dtype=dtype)
        k, v = (t.view(R, S, H, 64) for t in kv.chunk(4, dim=-1)[2:])
    else:
        k, v = (torch.randn(R, S, H, 64, generator=g).to(device=device, dtype=dtype)
                for _ in range(2))
    lens = torch.randint(1, S + 1, (R,), generator=g)
    lens[0] = S
    keep = (torch.arange(S)[None, :] < lens[:, None]).to(device)
    return q, k, v, keep


def test_cross_reference_is_masked_softmax_attention():
    """The cross reference equals softmax(q k^T + mask) v with cuDNN's finfo.min mask (the
    path it replaces) on requests with a real key."""
    q, k, v, keep = _cross_inputs(3, 5, 9, 2, 0)
    got = ta.cross_attention_reference(q, k, v, keep)
    mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    s = torch.einsum("rihd,rjhd->rhij", q, k) + mask
    want = torch.einsum("rhij,rjhd->rihd", torch.softmax(s, -1), v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ta.cross_attention(q, k, v, keep).equal(got)  # the CPU takes the reference
    keep[1] = False  # no real key: zeros (not NaN)
    assert ta.cross_attention_reference(q, k, v, keep)[1].eq(0).all()


def test_cross_bad_shapes_are_refused():
    q, k, v, keep = _cross_inputs(2, 4, 6, 2, 1)
    with pytest.raises(StreamgrError, match="cross_attention"):
        ta.cross_attention(q, k[:1], v[:1], keep)  # requests disagree
    with pytest.raises(StreamgrError, match="cross_attention"):
        ta.cross_attention(q, k, v, keep[:, :-1])
    with pytest.raises(StreamgrError, match="out must be"):
        ta.cross_attention(q, k, v, keep, out=torch.empty(2, 4, 2, 63))


@pytest.mark.gpu
@pytest.mark.parametrize("R,B,S,H,fused", [
    (1, 1, 1, 1, False), (32, 1, 784, 8, True), (3, 63, 65, 2, False), (2, 64, 128, 2, True),
    (2, 65, 129, 3, False), (2, 200, 300, 2, True), (32, 256, 784, 8, True),
    (1, 300, 2000, 2, False)])
def test_cross_kernel_matches_the_reference(R, B, S, H, fused):
    """Query counts around the 64-row consumers and 128-row blocks, key counts around the
    128-key tiles, gen-ref's step shapes (1 and 256 beams x 784 positions, fused views)."""
    q, k, v, keep = _cross_inputs(R, B, S, H, 13 * S + B, "cuda", torch.bfloat16, fused)
    if torch.cuda.get_device_capability() != (9, 0):
        assert not ta.cross_kernel_applies(q, k)
        return
    assert ta.cross_kernel_applies(q, k)
    for mask in ("prefix", "scattered"):
        if mask == "scattered":
            g = torch.Generator().manual_seed(S)
            keep = (torch.rand(R, S, generator=g) < 0.9).to("cuda")
            keep[:, :min(S, 130)] = True
            if R > 1:
                keep[-1] = False  # a request without a real key: zeros
        got = ta.cross_attention(q, k, v, keep)
        want = ta.cross_attention_reference(q, k, v, keep)
        assert got.shape == want.shape and got.is_contiguous() and not got.isnan().any()
        _close(got, want)


@pytest.mark.gpu
def test_cross_kernel_replays_from_a_graph_and_reads_unaligned_views():
    q, k, v, keep = _cross_inputs(4, 96, 150, 2, 9, "cuda", torch.bfloat16, True)
    if torch.cuda.get_device_capability() != (9, 0):  # refused, not faked
        assert not ta.cross_kernel_applies(q, k)
        return
    out = ta.cross_attention(q, k, v, keep)  # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ta.cross_attention(q, k, v, keep)
    q.normal_()
    keep[2, 70:] = False
    g.replay()
    torch.cuda.synchronize()
    want = ta.cross_attention_reference(q, k, v, keep)
    _close(out, want)
    wide = torch.zeros(4, 96, 2, 65, device="cuda", dtype=torch.bfloat16)
    wide[..., 1:] = q  # rows one element off 16 bytes: the reference, the same answer
    _close(ta.cross_attention(wide[..., 1:], k, v, keep), want)
    poisoned = torch.full_like(q, float("nan"))
    assert ta.cross_attention(q, k, v, keep, out=poisoned) is poisoned
    _close(poisoned, want)
