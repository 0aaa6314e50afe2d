"""The generate head's log-softmax, kept lazy: logits plus each row's max and log-sum-exp.

Beam search needs log-probabilities of a few columns per row (a beam's trie children: <= 177
of gen-ref's 24,579 tokens after the first step), but log-softmax over the full vocabulary is
what makes them equal to Hugging Face's. Writing the fp32 [rows, vocab] matrix costs more than
the head GEMM itself (a strided cast plus a log-softmax over it: docs/benchmarks.md).
``head_log_probs`` instead reads the bf16
logits once (``cuda_kernels/head_lse.cu``: per row max ``m`` and ``log(sum(exp(x - m)))`` in
fp32) and ``LogProbs.gather`` forms ``(x - m) - logsum`` for the gathered columns only: torch's
own log-softmax epilogue; only the order of the fp32 sum differs. fp32 logits, the CPU and
non-CUDA builds take ``F.log_softmax`` (the fp32 path stays bit-equal to Hugging Face's).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import StreamgrError
from . import _cuda

_SRC, _EXPR = "head_lse.cu", ("row_lse_bf16",)
_THREADS = 512
_SMEM_MAX = 200 * 1024  # rows up to ~100k bf16 columns staged in shared memory


class LogProbs:
    """``log_softmax(logits[:, :vocab])`` without the dense matrix: ``gather(index)`` gives the
    fp32 log-probabilities of those columns (``index`` [rows, n], columns < ``vocab``)."""

    def __init__(self, logits: torch.Tensor, vocab: int, stats: torch.Tensor) -> None:
        """``stats`` [2, rows] fp32: each row's max, then its log-sum-exp (``row_lse``); one
        array, which the selection kernels read as it is."""
        self.logits, self.vocab, self.stats = logits, vocab, stats

    row_max = property(lambda self: self.stats[0])
    row_logsum = property(lambda self: self.stats[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.logits.shape[0], self.vocab)

    def dim(self) -> int:
        return 2

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        x = self.logits.gather(1, index).float()
        return (x - self.row_max[:, None]) - self.row_logsum[:, None]

    def dense(self) -> torch.Tensor:
        """The whole [rows, vocab] fp32 matrix (for consumers that need it)."""
        return (self.logits[:, :self.vocab].float() - self.row_max[:, None]) \
            - self.row_logsum[:, None]


def gather_log_probs(logp: "torch.Tensor | LogProbs", index: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities at ``index`` from a dense matrix or a ``LogProbs``."""
    if isinstance(logp, LogProbs):
        return logp.gather(index)
    return logp.float().gather(1, index)


def row_lse_reference(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[2, rows] fp32: each row's max, then log(sum(exp(x - max))), over the first ``vocab``
    columns."""
    x = logits[:, :vocab].float()
    m = x.max(dim=1).values
    return torch.stack([m, torch.log(torch.exp(x - m[:, None]).sum(dim=1))])


def row_lse(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``row_lse_reference`` by the CUDA kernel where it applies (bf16 CUDA logits with unit
    column stride), else by the reference."""
    if logits.dim() != 2 or not 1 <= vocab <= logits.shape[1]:
        raise StreamgrError(f"row_lse: logits [rows, >= {vocab}] expected, got "
                            f"{tuple(logits.shape)}")
    rows = logits.shape[0]
    if (logits.dtype != torch.bfloat16 or logits.stride(1) != 1 or rows == 0
            or not _cuda.usable(logits)):
        return row_lse_reference(logits, vocab)
    stats = torch.empty(2, rows, dtype=torch.float32, device=logits.device)
    m, s = stats
    smem = vocab * 2
    use_smem = smem <= _SMEM_MAX and logits.data_ptr() % 16 == 0 and logits.stride(0) % 8 == 0
    fn = _cuda.kernel(_SRC, _EXPR, _EXPR[0])
    _cuda.launch(fn, (rows,), (_THREADS,), (
        _cuda.ptr(logits), np.int64(logits.stride(0)), np.int32(vocab), np.int32(use_smem),
        _cuda.ptr(m), _cuda.ptr(s)), shared_mem=smem if use_smem else 0)
    return stats


def head_log_probs(logits: torch.Tensor, vocab: int) -> "torch.Tensor | LogProbs":
    """Log-probabilities over the first ``vocab`` columns of ``logits`` [rows, >= vocab]:
    a ``LogProbs`` for bf16 CUDA logits, else the dense fp32 ``F.log_softmax``."""
    if logits.is_cuda and logits.dtype == torch.bfloat16 and not _cuda.FORCE_TORCH \
            and _cuda.usable(logits):
        return LogProbs(logits, vocab, row_lse(logits, vocab))
    return F.log_softmax(logits[:, :vocab], dim=-1, dtype=torch.float32)
