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
