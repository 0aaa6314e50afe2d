"""T5 model pieces: the encoder's relative-position bias from the 2S-1 distances equals the
S x S lookup it replaced."""

from __future__ import annotations

import pytest
import torch

from streamgr.kernels.encoder_bias import encoder_bias_reference
from streamgr.models.t5 import T5, T5Config


@pytest.mark.parametrize("S", [1, 2, 7, 129, 300])
def test_encoder_bias_equals_the_pairwise_lookup(S):
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128)
    model = T5(cfg).init_random(S)
    attn = model.encoder.block[0].layer[0].SelfAttention
    pos = torch.arange(S)
    want = model._bias(attn, pos, pos, True)
    table = model._encoder_bias(attn, S, torch.device("cpu"))
    assert table.shape == (4, 2 * S - 1)
    got = encoder_bias_reference(table, torch.ones(1, S, dtype=torch.bool), torch.float32)
    assert got.shape == (1, 4, S, S)
    assert torch.equal(got[0], want)


@pytest.mark.parametrize("gated", [False, True])
def test_fused_glue_equals_the_two_step_path(gated, monkeypatch):
    """The half-precision CUDA glue (residual added in the GEMM, ReLU in its epilogue) computes
    what the step-by-step path does; run here on the CPU in fp32 by forcing that branch."""
    from streamgr.models import t5
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                   feed_forward_proj="gated-gelu" if gated else "relu")
    model = T5(cfg).init_random(3)
    ff = model.encoder.block[0].layer[1].DenseReluDense
    attn = model.encoder.block[0].layer[0].SelfAttention
    g = torch.Generator().manual_seed(0)
    x, h, res = (torch.randn(3, 5, 32, generator=g) for _ in range(3))
    want_ff, want_o = res + ff(x), res + attn.o(h)
    monkeypatch.setattr(t5, "fused", lambda _: True)
    torch.testing.assert_close(ff(x, residual=res.clone()), want_ff)
    # The fused path writes over its residual (the caller rebinds it), contiguous or not.
    r = res.clone()
    out = t5.residual_linear(r, h, attn.o)
    torch.testing.assert_close(out, want_o)
    assert out.data_ptr() == r.data_ptr()
    strided = res.clone().transpose(0, 1)
    torch.testing.assert_close(t5.residual_linear(strided, h.transpose(0, 1), attn.o),
                               want_o.transpose(0, 1))
    assert ff(x, residual=res.clone()).shape == (3, 5, 32)


def _bf16_model(seed=4):
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=4)
    return T5(cfg).init_random(seed).to(torch.bfloat16).eval()


def test_fused_projections_are_views_and_give_the_separate_gemms():
    """``t5_fuse``: q/k/v (and every decoder layer's cross k/v) become views of one buffer;
    the fused GEMM gives what the three GEMMs give (bf16), cross K/V as [R, S, H, d] views."""
    from streamgr.models import t5_fuse
    plain = _bf16_model()
    model = t5_fuse.fuse_projections(_bf16_model())
    assert torch.equal(plain.state_dict()["encoder.block.0.layer.0.SelfAttention.k.weight"],
                       model.state_dict()["encoder.block.0.layer.0.SelfAttention.k.weight"])
    a = model.decoder.block[1].layer[0].SelfAttention
    assert a.k.weight.data_ptr() == a._qkv[32:].data_ptr()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    for got, lin in zip(t5_fuse.qkv(a, h), (a.q, a.k, a.v)):
        assert got.stride(0) == 96  # a column slice of the fused output
        torch.testing.assert_close(got, lin(h), rtol=0, atol=1e-2)
    enc = torch.randn(2, 5, 32, generator=g).to(torch.bfloat16)
    for (k, v), (k0, v0) in zip(model.cross_kv(enc), plain.cross_kv(enc)):
        assert k.shape == (2, 5, 4, 8) and k.stride(1) == 4 * 32  # two layers' k|v
        torch.testing.assert_close(k, k0, rtol=0, atol=1e-2)
        torch.testing.assert_close(v, v0, rtol=0, atol=1e-2)


def test_fused_projections_follow_in_place_writes_and_refuse_replaced_weights():
    """A refit writes the state dict's tensors in place: the fused GEMM sees the new weights.
    A weight replaced by another tensor breaks the views: the separate GEMMs run (never the
    stale buffer)."""
    from torch import nn

    from streamgr.models import t5_fuse
    model = t5_fuse.fuse_projections(_bf16_model())
    new = _bf16_model(seed=9).state_dict()
    dst = model.state_dict()
    with torch.no_grad():
        torch._foreach_copy_(list(dst.values()), [new[k] for k in dst])
    a = model.encoder.block[0].layer[0].SelfAttention
    h = torch.randn(3, 32).to(torch.bfloat16)
    want = h @ new["encoder.block.0.layer.0.SelfAttention.v.weight"].t()
    torch.testing.assert_close(t5_fuse.qkv(a, h)[2], want, rtol=0, atol=1e-2)
    a.v.weight = nn.Parameter(torch.zeros_like(a.v.weight), requires_grad=False)
    assert not t5_fuse._views_of(a._qkv, (a.q, a.k, a.v))
    assert t5_fuse.qkv(a, h)[2].eq(0).all()
    dec = model.decoder.block[0].layer[1].EncDecAttention
    dec.k.weight = nn.Parameter(torch.zeros_like(dec.k.weight), requires_grad=False)
    assert model.cross_kv(torch.randn(1, 4, 32).to(torch.bfloat16))[0][0].eq(0).all()
