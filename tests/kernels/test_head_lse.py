"""The lazy head log-softmax (kernels/head_lse.py) against F.log_softmax, on the CPU (the torch
reference path) and, marked gpu, the CUDA kernel on bf16 logits: vocabulary tails, strided and
unaligned rows, a vocabulary too wide for shared memory, one row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamgr.errors import StreamgrError
from streamgr.kernels.head_lse import (LogProbs, gather_log_probs, head_log_probs, row_lse,
                                       row_lse_reference)


def logits_and_index(rows, cols, vocab, device, dtype, seed, offset=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    flat = (4 * torch.randn(offset + rows * cols, generator=g)).to(dtype)
    x = flat[offset:].view(rows, cols).to(device)
    idx = torch.randint(0, vocab, (rows, 37), generator=g).to(device)
    return x, idx


@pytest.mark.parametrize("rows,cols,vocab", [(1, 5, 5), (9, 64, 61), (33, 1000, 999)])
def test_reference_equals_log_softmax(rows, cols, vocab):
    x, idx = logits_and_index(rows, cols, vocab, "cpu", torch.bfloat16, rows)
    lp = LogProbs(x, vocab, row_lse_reference(x, vocab))
    want = F.log_softmax(x[:, :vocab], dim=-1, dtype=torch.float32)
    torch.testing.assert_close(lp.gather(idx), want.gather(1, idx), rtol=0, atol=2e-6)
    torch.testing.assert_close(lp.dense(), want, rtol=0, atol=2e-6)
    assert lp.shape == (rows, vocab) and lp.dim() == 2
    # a dense matrix and a LogProbs gather alike
    torch.testing.assert_close(gather_log_probs(want, idx), want.gather(1, idx))


def test_cpu_returns_the_dense_log_softmax():
    x, _ = logits_and_index(4, 50, 47, "cpu", torch.bfloat16, 0)
    out = head_log_probs(x, 47)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.log_softmax(x[:, :47], -1, dtype=torch.float32))


def test_bad_shapes_are_refused():
    with pytest.raises(StreamgrError):
        row_lse(torch.zeros(3, 4), 5)
    with pytest.raises(StreamgrError):
        row_lse(torch.zeros(3), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,vocab,offset", [
    (4096, 24640, 24579, 0),   # gen-ref's head: aligned buffer, staged in shared memory
    (7, 24640, 24579, 3),      # unaligned rows: scalar loads
    (5, 130_001, 130_000, 0),  # too wide for shared memory: read twice
    (1, 8, 1, 0), (3, 17, 9, 1), (2, 16, 16, 0)])
def test_kernel_equals_reference(rows, cols, vocab, offset):
    x, idx = logits_and_index(rows, cols, vocab, "cuda", torch.bfloat16, rows + cols, offset)
    m, s = row_lse(x, vocab)
    rm, rs = row_lse_reference(x, vocab)
    torch.testing.assert_close(m, rm, rtol=0, atol=0)  # a max is exact
    torch.testing.assert_close(s, rs, rtol=2e-6, atol=2e-6)  # only the sum's order differs
    lp = head_log_probs(x, vocab)
    assert isinstance(lp, LogProbs)
    want = F.log_softmax(x[:, :vocab], dim=-1, dtype=torch.float32)
    torch.testing.assert_close(lp.gather(idx), want.gather(1, idx), rtol=0, atol=4e-6)
