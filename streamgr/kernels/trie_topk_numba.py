"""Host side of the Numba CUDA kernels of ``trie_topk`` (see its module docstring for what they
compute): where a request's candidates split over a few blocks of at most ``ONE_MAX`` each, one
launch whose blocks list their best and whose last block selects from the list
(``trie_topk_merge``); a request of one beam (a search's first step) of up to eight blocks of
candidates is one block of eight candidates a thread (``trie_topk_root``); else a request of at most
a block of candidates is one block of one candidate a thread (``trie_topk_own``), one of at most
four blocks wanting over half a block four candidates a thread (``trie_topk_quad``), one of at most
``ONE_MAX`` one block that bins (or radix-selects) first (``trie_topk_one``), a longer one the grid:
one launch whose blocks keep their own best in bin order for the last block
(``trie_topk_kept``, where beam units fit) or two launches (``trie_topk_bins``);
the keys, scans and sort they share are in ``trie_topk_keys`` and ``trie_topk_dev``.

Imported only when they run: a CUDA device with numba-cuda, or ``NUMBA_ENABLE_CUDASIM=1``.
Arrays come from torch without copies (``__cuda_array_interface__``, no stream sync, so a
CUDA graph can capture the launches); kernels launch on torch's current stream. The grid and merge
paths take their counters from ``counters.zeroed`` (a captured plan's own, left zero by the
kernels: no fill node in its graph); the one-block paths need no global scratch.
"""

from __future__ import annotations

import torch

from . import trie_topk_bins as bins
from . import trie_topk_merge as tm
from .head_lse import LogProbs
from .numba_common import as_array, torch_stream
from .trie_topk import SIMULATED
from .trie_topk_dev import NT
from .trie_topk_index import magic
from .trie_topk_one import ONE_MAX, one_select
from .trie_topk_own import OWN, own_select
from .trie_topk_quad import quad_select, serves as quad_serves
from .trie_topk_root import root_select, serves as root_serves


def run(scores, nodes, logp, ptr, codes, off: int, F: int, k: int, cap):
    R, B = scores.shape
    N = B * F
    dev = scores.device
    top = torch.empty(R, k, dtype=torch.float32, device=dev)
    parent, child, code = (torch.empty(R, k, dtype=torch.int64, device=dev) for _ in range(3))
    stream = 0 if SIMULATED else torch_stream(dev)
    launch = lambda fn, g, t, smem=0: fn[g, t, stream, smem]  # noqa: E731
    a = as_array
    sc = scores.float().contiguous()
    if len(codes) == 0:  # no children anywhere: every candidate -inf; keep the loads in bounds
        codes = torch.zeros(1, dtype=codes.dtype, device=dev)  # the same kernels as the trie's
    lp = _log_probs(logp, a, sc)
    trie = (a(ptr), a(unit_stride(codes)), off)
    outs = (a(cap.contiguous()), a(top), a(parent), a(child), a(code))
    KP = 1 << max(0, (k - 1).bit_length())
    sa, nd = a(sc), a(nodes.contiguous())
    root = root_serves(B, N)  # before the merge: under the simulator their sizes overlap
    merge = None if root else tm.plan_for(N, R, k, dev)
    if root:
        launch(root_select, (R,), NT)(N, k, KP, F, magic(F), B, sa, nd, *lp, *trie, *outs)
    elif merge is not None:
        tm.run(launch, R, N, k, KP, *merge, F, magic(F), B, sa, nd, lp, trie, outs, dev, a)
    elif quad_serves(N, k):
        launch(quad_select, (R,), NT)(N, k, KP, F, magic(F), B, sa, nd, *lp, *trie, *outs)
    elif OWN and N <= NT:
        launch(own_select, (R,), NT)(N, k, KP, F, magic(F), B, sa, nd, *lp, *trie, *outs)
    elif N <= ONE_MAX:
        launch(one_select, (R,), NT)(N, k, KP, F, magic(F), B, sa, nd, *lp, *trie, *outs)
    else:
        bins.run(launch, R, N, k, KP, F, magic(F), B, sa, nd, lp, trie, outs, dev, a)
    return top, parent, child, code


def _log_probs(logp, a, sc) -> tuple:
    """(bits, [2, rows] max and log-sum, shift) for the kernels' ``cand``: a ``LogProbs`` over
    bf16 logits is read in place (int16 bits, shift 16: no [rows, vocab] fp32 matrix); fp32
    log-probabilities (int32 bits) need no table: shift 0 tells the kernels to skip it, and
    ``sc`` viewed as [1, rows] stands in for it (read, unused: a [2, rows] zeros tensor would
    be a memset in every graph)."""
    if isinstance(logp, LogProbs) and logp.logits.dtype == torch.bfloat16:
        return a(unit_stride(logp.logits).view(torch.int16)), a(logp.stats), 16
    if isinstance(logp, LogProbs):
        logp = logp.dense()
    return a(unit_stride(logp.float()).view(torch.int32)), a(sc.view(1, -1)), 0


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dimension's elements adjacent (a copy only where they are not): the
    kernels read logits rows and codes through ``numba_common.load_at``, element ``n`` at
    ``n`` times the item size past the row's start."""
    return t if t.stride(-1) == 1 else t.contiguous()
