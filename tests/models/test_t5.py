"""T5 model pieces: the encoder's relative-position bias from the 2S-1 distances equals the
S x S lookup it replaced."""

from __future__ import annotations

import pytest
import torch

from streamgr.models.t5 import T5, T5Config


@pytest.mark.parametrize("S", [1, 2, 7, 129, 300])
def test_encoder_bias_equals_the_pairwise_lookup(S):
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128)
    model = T5(cfg).init_random(S)
    attn = model.encoder.block[0].layer[0].SelfAttention
    pos = torch.arange(S)
    want = model._bias(attn, pos, pos, True)
    got = model._encoder_bias(attn, S, torch.device("cpu"))
    assert got.shape == (4, S, S) and got.is_contiguous()
    assert torch.equal(got, want)
