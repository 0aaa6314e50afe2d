"""GPU: the HSTU layer glue kernels (``cuda_kernels/hstu_norm.cu``) against their torch
references: the input LayerNorm, the SiLU pass over a column block, the token embedding, and the
fused layer end taking ``u`` before its SiLU. Fresh random data, boundary sizes, strided and
unaligned inputs (which must fall back to the reference, not read wrongly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from streamgr.kernels import hstu_glue

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
ULP = 2.0 ** -7  # one bf16 unit in the last place, relative


def rnd(g, *shape):
    return torch.randn(*shape, device=DEV, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("T,M", [(1, 64), (37, 96), (2088, 512), (9001, 512)])
@pytest.mark.parametrize("strided", [False, True])
def test_layer_norm_matches_torch(T, M, strided):
    g = torch.Generator(device=DEV).manual_seed(T * M + strided)
    norm = nn.LayerNorm(M, eps=1e-6).to(DEV, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * rnd(g, M)), norm.bias.copy_(0.1 * rnd(g, M))
        x = rnd(g, T, 3 * M)[:, M:2 * M] if strided else rnd(g, T, M) * 4 + 2
        got, ref = hstu_glue.layer_norm(x, norm), norm(x)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    # both round an fp32 result once: they may differ by a unit where the statistics' order
    # of summation moves a value across a rounding boundary
    torch.testing.assert_close(got.float(), ref.float(), rtol=ULP, atol=ULP)
    assert (got == ref).float().mean().item() > 0.95


def test_layer_norm_falls_back_on_unaligned_rows():
    g = torch.Generator(device=DEV).manual_seed(5)
    norm = nn.LayerNorm(64, eps=1e-6).to(DEV, torch.bfloat16)
    x = rnd(g, 10, 65)[:, 1:]  # rows not 16-byte aligned
    with torch.no_grad():
        torch.testing.assert_close(hstu_glue.layer_norm(x, norm), norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("T,C,offset", [(1, 8, 0), (37, 1536, 512), (5000, 1536, 512),
                                        (13, 24, 8)])
def test_silu_matches_torch(T, C, offset):
    g = torch.Generator(device=DEV).manual_seed(T + C + offset)
    wide = rnd(g, T, offset + C + 16) * 6
    t = wide[:, offset:offset + C]
    got, ref = hstu_glue.silu(t), F.silu(t)
    assert got.is_contiguous() and got.shape == (T, C)
    torch.testing.assert_close(got.float(), ref.float(), rtol=ULP, atol=1e-6)
    assert (got == ref).float().mean().item() > 0.99


@pytest.mark.parametrize("T", [1, 255, 52000])
def test_embed_matches_the_reference_bit_for_bit(T):
    g = torch.Generator(device=DEV).manual_seed(T)
    M = 512
    items, actions = nn.Embedding(5000, M), nn.Embedding(7, M)
    position = nn.Embedding(301, M)
    for e in (items, actions, position):
        e.to(DEV, torch.bfloat16)
    is_action = torch.rand(T, device=DEV, generator=g) < 0.5
    ids = torch.where(is_action, torch.randint(0, 7, (T,), device=DEV, generator=g),
                      torch.randint(0, 5000, (T,), device=DEV, generator=g))
    pos = torch.randint(0, 301, (T,), device=DEV, generator=g)
    with torch.no_grad():
        got = hstu_glue.embed(ids, is_action, pos, items, actions, position)
        ref = hstu_glue.embed_reference(ids, is_action, pos, items, actions, position)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("T,N,M", [(1, 512, 512), (37, 64, 96), (2088, 512, 512)])
def test_fused_layer_end_applies_the_gate_silu(T, N, M):
    """finish with u before its SiLU (u_raw) equals finish with F.silu(u) within a bf16 unit
    per element of y, and the layer's output within bf16 tolerance of the fp32 reference."""
    g = torch.Generator(device=DEV).manual_seed(T + N)
    norm = nn.LayerNorm(N, eps=1e-6).to(DEV, torch.bfloat16)
    out = nn.Linear(N, M).to(DEV, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * rnd(g, N)), norm.bias.copy_(0.1 * rnd(g, N))
        x, attn = rnd(g, T, M), rnd(g, T, N) * 3 + 1
        u_raw = (rnd(g, T, 4 * N) * 3)[:, :N]  # u's block of a [T, 4N] projection, pre-SiLU
        assert hstu_glue.fused_ok(x, None, u_raw, norm, out)
        y_raw, _ = hstu_glue.norm_mul(x, attn, u_raw, norm, out.bias, u_raw=True)
        y_ref, _ = hstu_glue.norm_mul(x, attn, F.silu(u_raw), norm, out.bias)
        torch.testing.assert_close(y_raw.float(), y_ref.float(), rtol=2 * ULP, atol=1e-3)
        got = hstu_glue.finish(x, attn, u_raw, norm, out, u_raw=True)
        ref = hstu_glue.finish_reference(x.float(), attn.float(), u_raw.float(), norm.float(),
                                         out.float(), u_raw=True)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
