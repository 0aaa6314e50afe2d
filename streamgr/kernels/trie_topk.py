"""Trie-constrained beam selection: each beam's trie children scored, each request's top ``k``.

One step of the SID beam search (RecoGEM section 3.2): beam ``b`` of request ``r`` with score
``s[r, b]`` at trie node ``n[r, b]`` offers its children ``ptr[n] .. ptr[n+1]`` (codes
``codes[child]``), each scored ``s[r, b] + logp[r * B + b, off + code]``. Candidates are laid out
as Hugging Face's flattened beams x children grid, ``c = b * F + j`` (``F`` the level's widest
fan-out; a non-child or a dead beam's slot scores ``-inf``). The ``k`` best per request come out
best first, ties to the lower ``c`` (a stable order: deterministic on every device), with
their parent beam, child node and code; ranks at or past a request's own width ``cap[r]`` score
``-inf``.

Kernels (Numba CUDA, on torch's stream, captured inside the decode plans' CUDA graphs): every
candidate is a unique int64 key, its score's order-preserving bits then ``MAXC - c``, read from the
top of the request's score range (``trie_topk_keys``), so no ties are left to break. A request of at
most a block of candidates (step 3) is one block of one candidate a thread: one round of score bins,
the keys from the picked bin up ranked in their bins by the threads of their slots, each answer read
from the candidates' score, child and code held in shared memory (``trie_topk_own``). One of up to
four blocks of candidates wanting over half a block (step 3 at beams of 1,024) is one block of four
candidates a thread, the okeys in registers: a round of those bins, a second of linear bins over the
distances from the ``k``-th's bin up, the keys there ranked in their bins and answered from each
candidate's held child and code (``trie_topk_quad``). One beam's children (step 1: the root's), over
a block and at most eight, are one block of eight candidates a thread in registers, the bins counted
from a sampled cutoff up (``trie_topk_root``). One of at most ``ONE_MAX`` candidates is one block of
one launch: keys in shared memory, a list of the keys at or above a floor sampled from them (or
every key, up to ``UCAP``), one histogram round over bins of each listed score's distance below the
best, then the keys of the bins from the ``k``-th up ranked within their bins (or sorted whole where
a bin is crowded), or radix select by 10-bit digits where the list outgrows a block; decode
(``trie_topk_one``, ``trie_topk_sample``). A longer one takes two grid launches: each
block loads its beams into shared memory, scores its candidates (a code and a log-probability
load each), writes their keys and bins their scores below the request's best beam score; then
each block picks the bin of the ``k``-th from the request's histogram, reads its keys back and
appends those from that bin up to a list; the request's last block ranks the list by linear bins
and answers from loads issued along the ranking (or radix-selects from it where ties crowd the
bin) (``trie_topk_bins``, ``trie_topk_beams``, ``trie_topk_rank``, ``trie_topk_index``). Where
a request splits over a few blocks of at most ``ONE_MAX`` each (in up to two waves) and ``k``
is at most half a block, one launch instead: each block lists its own best
keys, and the request's last block selects from that list (``trie_topk_merge``).
``NUMBA_ENABLE_CUDASIM=1`` runs the same kernels on the CPU with small sizes, so CI checks their
logic. The torch reference (``trie_topk_reference``) carries the CPU path.
"""

from __future__ import annotations

import functools
import os

import torch

from ..errors import StreamgrError
from .head_lse import gather_log_probs

NEG_INF = float("-inf")
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
MAX_K = 1024
# The kernels' candidates of a request (beams x fan-out): their keys hold the index in 31 bits
# and their c // F is exact below 2**30 (trie_topk_index.magic); past it the stable reference.
NUMBA_MAX_N = 1 << 30
SIM_MAX_K = 32  # the simulator's select blocks (32 threads) sort at most this many


def trie_topk_reference(scores: torch.Tensor, nodes: torch.Tensor, logp: torch.Tensor,
                        ptr: torch.Tensor, codes: torch.Tensor, off: int, fanout: int, k: int,
                        cap: torch.Tensor, stable: bool = True):
    """(top [R, k] fp32, parent [R, k], child [R, k], code [R, k]) as the module docstring says.
    ``scores``, ``nodes``: [R, B]; ``logp``: [R * B, V] (or a lazy ``LogProbs``); ``cap``:
    [R]. ``stable=False`` selects
    with ``torch.topk`` (the serving default: the fastest measured, ties as Hugging Face's beam
    search breaks them, device-dependent)."""
    R, B = scores.shape
    F = max(fanout, 1)
    valid = torch.isfinite(scores).view(-1)
    n = torch.where(valid, nodes.view(-1), 0)
    lo = ptr[n]
    count = torch.where(valid, ptr[n + 1] - lo, 0)
    slot = torch.arange(F, device=scores.device)
    real = slot[None, :] < count[:, None]
    child = torch.where(real, lo[:, None] + slot[None, :], 0)
    code = torch.where(real, codes[child.clamp(max=max(len(codes) - 1, 0))].long(), 0) \
        if len(codes) else torch.zeros_like(child)
    cand = scores.view(-1, 1).float() + gather_log_probs(logp, off + code)
    cand = cand.masked_fill(~real, NEG_INF).view(R, B * F)
    if stable:
        top, idx = torch.sort(cand, dim=1, descending=True, stable=True)
        top, idx = top[:, :k], idx[:, :k]
    else:
        top, idx = cand.topk(k, dim=1)
    rank = torch.arange(k, device=scores.device)[None, :]
    top = top.masked_fill(rank >= cap.view(-1, 1), NEG_INF)
    return (top, idx // F, child.view(R, B * F).gather(1, idx),
            code.view(R, B * F).gather(1, idx))


def _check(scores, nodes, logp, k, fanout):
    if scores.dim() != 2 or nodes.shape != scores.shape:
        raise StreamgrError("trie_topk: scores and nodes must be [requests, beams]")
    if logp.dim() != 2 or logp.shape[0] != scores.numel():
        raise StreamgrError(f"trie_topk: logp must be [requests * beams, vocab], got "
                            f"{tuple(logp.shape)}")
    if not 1 <= k <= min(MAX_K, scores.shape[1] * max(fanout, 1)):
        raise StreamgrError(f"trie_topk: k = {k} outside 1..min({MAX_K}, beams x fan-out)")


# The Numba kernels serve by default on CUDA (STREAMGR_SELECTION=topk: the torch step). Against
# torch.topk alone they run at 1.31x-2.79x over gen-ref's step shapes, and the torch step also
# gathers each candidate's log-probability out of the bf16 logits first, which the kernels read
# in place: the whole bf16 step 3.93x-9.10x faster (docs/benchmarks.md, session 29). Their ties
# go to the lower candidate index on every device; the CPU keeps torch.topk's.
DEFAULT_IMPL = os.environ.get("STREAMGR_SELECTION", "numba").lower()


def usable(t: torch.Tensor) -> bool:
    """The Numba kernels can run for these tensors (CUDA with numba-cuda). Under the simulator
    they run only when asked (``impl="numba"``): it is far too slow to serve with."""
    if SIMULATED or not t.is_cuda:
        return False
    return _numba_cuda() is not None


@functools.lru_cache(maxsize=None)
def _numba_cuda():
    try:
        from numba import config, cuda
        # Small grids are by design here (a few requests' rows): Numba's per-launch
        # low-occupancy warning only floods a server's log.
        config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        return cuda if cuda.is_available() else None
    except Exception:  # not installed, or its numpy is not one it supports
        return None


def trie_topk(scores: torch.Tensor, nodes: torch.Tensor, logp: torch.Tensor, ptr: torch.Tensor,
              codes: torch.Tensor, off: int, fanout: int, k: int, cap: torch.Tensor,
              impl: str | None = None):
    """``impl`` (default ``STREAMGR_SELECTION``, else ``"numba"``): ``"numba"``: the Numba
    kernels, stable ties (CUDA; the CPU under ``NUMBA_ENABLE_CUDASIM=1`` only when asked by
    name; elsewhere the reference over ``torch.topk``); ``"topk"``: the reference over
    ``torch.topk``; ``"stable"``: the reference with stable ties."""
    _check(scores, nodes, logp, k, fanout)
    asked, impl = impl, impl or DEFAULT_IMPL
    if impl == "numba" and scores.shape[1] * max(fanout, 1) > NUMBA_MAX_N:
        impl = "stable"  # the kernels' candidate indices would not fit: the same order in torch
    if impl != "numba" or not (usable(scores) or SIMULATED and asked == "numba") \
            or SIMULATED and k > SIM_MAX_K:
        return trie_topk_reference(scores, nodes, logp, ptr, codes, off, fanout, k, cap,
                                   stable=impl == "stable")
    from . import trie_topk_numba as nb
    return nb.run(scores, nodes, logp, ptr, codes, off, max(fanout, 1), k, cap)
