"""The encoder's dense attention bias: the torch reference's meaning on the CPU, and the CUDA
kernel bit-equal to it on the GPU (random tables, padded rows, boundary lengths)."""

from __future__ import annotations

import pytest
import torch

from streamgr.errors import StreamgrError
from streamgr.kernels.encoder_bias import encoder_bias, encoder_bias_reference


def _inputs(R, H, S, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(H, 2 * S - 1, generator=g)
    lens = torch.randint(1, S + 1, (R,), generator=g)
    keep = torch.arange(S)[None, :] < lens[:, None]
    return table.to(device), keep.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_windowed_table_plus_padding(dtype):
    R, H, S = 3, 2, 5
    table, keep = _inputs(R, H, S, 1)
    got = encoder_bias_reference(table, keep, dtype)
    assert got.shape == (R, H, S, S) and got.dtype == dtype
    low = torch.finfo(dtype).min
    for r in range(R):
        for h in range(H):
            for i in range(S):
                for j in range(S):
                    want = table[h, j - i + S - 1].to(dtype) if keep[r, j] else low
                    assert got[r, h, i, j] == want, (r, h, i, j)
    assert encoder_bias(table, keep, dtype).equal(got)  # the CPU takes the reference


def test_a_table_of_the_wrong_size_is_refused():
    table, keep = _inputs(2, 2, 8, 0)
    with pytest.raises(StreamgrError, match="table"):
        encoder_bias(table[:, :-1], keep, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("R,H,S", [(1, 1, 8), (3, 8, 16), (16, 8, 832), (5, 4, 136), (2, 3, 7)])
def test_kernel_equals_reference_bit_for_bit(R, H, S):
    table, keep = _inputs(R, H, S, R * S, "cuda")
    want = encoder_bias_reference(table, keep, torch.bfloat16)
    got = encoder_bias(table, keep, torch.bfloat16)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
def test_kernel_on_unaligned_views():
    """A transposed table and a padding mask sliced off by one row (non-contiguous inputs)."""
    table, keep = _inputs(5, 8, 64, 9, "cuda")
    t_view = table.t().contiguous().t()  # same values, column-major
    k_view = torch.cat([keep[:1], keep])[1:]
    flat = torch.zeros(keep.numel() + 3, dtype=torch.bool, device="cuda")
    flat[3:] = keep.reshape(-1)
    k_odd = flat[3:].view_as(keep)  # contiguous, 3 bytes off alignment
    want = encoder_bias_reference(table, keep, torch.bfloat16).view(torch.int16)
    for k in (k_view, k_odd):
        assert torch.equal(encoder_bias(t_view, k, torch.bfloat16).view(torch.int16), want)
