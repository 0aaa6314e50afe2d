"""Trie-constrained wide beam search over semantic IDs (RecoGEM section 3.2, the runtime side).

The encoder runs once per request; the cross-attention K/V stay at [requests] and each beam
attends its request's by index. Per step ``t``: the decoder for all live beams (self K/V per
beam), log-softmax over the full vocabulary, each beam's trie children scored as a
[beams, widest fan-out] grid (what is not a child is not a candidate) and the top ``W_t`` per
request over that grid kept, best first, ties to the lower grid index (``kernels.trie_topk``:
the same set as over beams x codebook with non-children masked, in far less memory), and the
survivors' self K/V gathered, whole [heads x d] rows per position, into the next step's buffer
(compaction). Scores are summed log-probabilities, as Hugging Face's beam search with
``prefix_allowed_tokens_fn`` and no length penalty. No illegal SID can come out: only trie
children are ever selectable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels.trie_topk import trie_topk
from ..models.t5 import T5
from ..selection.vocabulary import SidTrie
from .plans import aligned_length
from .sid_rows import SidRows
from .variants import keep_mask

if TYPE_CHECKING:
    from .plans import PlanCache

NEG_INF = float("-inf")


@dataclass
class BeamRequest:
    context: np.ndarray  # encoder input tokens (SID tokens of the history, then EOS)
    top_k: int
    widths: list[int]  # beam width per step
    exclude: np.ndarray | None = None  # sorted item ids never answered (runtime/variants.py)
    max_per_prefix: int = 0  # items per first SID code in the answer (0: no cap)


@dataclass
class BeamResult:
    items: list[int]
    scores: list[float]
    sids: list[list[int]]  # or a SidRows (answer_batch)
    steps: dict[str, float] = field(default_factory=dict)


@dataclass
class Submitted:
    """A batch on its way: final beams (scores, trie nodes, codes) on the host, valid once
    ``event`` has completed (``None``: already valid); ``start``: an event recorded before
    the batch's device work (CUDA), for its GPU time."""
    reqs: list[BeamRequest]
    beams: tuple
    event: object
    stages: dict
    start: object = None


class BeamSearch:
    """The step loop. ``run`` builds a batch's host inputs, then either runs ``search`` eagerly
    or replays the batch shape's captured plan (``plans``, CUDA only): the search has static
    shapes and no host sync, so one CUDA graph holds the whole of it."""

    def __init__(self, model: T5, trie: SidTrie, sid_policy: str = "all",
                 plans: "PlanCache | None" = None) -> None:
        self.model, self.trie, self.policy = model, trie, sid_policy
        self.plans = plans
        self.sync = False  # benchmarks: time stages on the device (runs eagerly)

    def _tick(self, stages: dict | None, name: str, t: float, device) -> float:
        if stages is None:
            return t
        if self.sync and device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        stages[name] = stages.get(name, 0.0) + (now - t) * 1e3
        return now

    def step_widths(self, widths: list[list[int]]) -> tuple[int, ...]:
        """Beams kept after each step for the whole batch (host-side, so shapes are static):
        the widest request's width, and at the last step the widest of all, capped by what the
        trie can offer (beams x the level's widest fan-out)."""
        w_max = max(max(w) for w in widths)
        out, beams = [], 1
        for t in range(self.trie.depth):
            want = w_max if t == self.trie.depth - 1 else max(w[t] for w in widths)
            beams = min(want, beams * max(self.trie.max_fanout[t], 1))
            out.append(beams)
        return tuple(out)

    def inputs(self, reqs: list[BeamRequest], rows: int | None = None, length: int | None = None,
               out: tuple[torch.Tensor, ...] | None = None):
        """Host tensors of a batch: encoder tokens and mask [rows, length] (right-padded; rows
        past the requests are idle: one EOS, width 0) and each request's widths [rows, depth].
        ``out``: (tokens, mask, cap) CPU tensors of those shapes to fill in place (a decode
        plan's pinned staging buffers), else new ones."""
        cfg = self.model.cfg
        rows = rows or len(reqs)
        length = length or aligned_length(max(len(r.context) for r in reqs))
        if out is None:
            out = (torch.empty(rows, length, dtype=torch.long),
                   torch.empty(rows, length, dtype=torch.bool),
                   torch.empty(rows, self.trie.depth, dtype=torch.long))
        tokens, mask, cap = (x.numpy() for x in out)
        # Array-wise (one scatter of all contexts), not a row at a time: host time per batch.
        n = len(reqs)
        lens = np.fromiter((len(r.context) for r in reqs), dtype=np.int64, count=n)
        np.less(np.arange(length)[None, :], lens[:, None], out=mask[:n])
        mask[n:] = False
        mask[n:, 0] = True
        tokens.fill(cfg.pad_token_id)
        tokens[:n][mask[:n]] = np.concatenate([r.context for r in reqs]) if n else []
        tokens[n:, 0] = cfg.eos_token_id
        cap.fill(0)
        cap[:n] = [r.widths for r in reqs]
        return out

    def search(self, tokens, mask, cap, w_steps: tuple[int, ...], stages: dict | None = None):
        """The device part: encoder, then per step decoder, selection and compaction. Returns
        the final beams' (scores, trie nodes, codes) [rows, w_steps[-1](, depth)], best first."""
        model, trie, cfg = self.model, self.trie, self.model.cfg
        dev = tokens.device
        R, depth = tokens.shape[0], trie.depth
        t0 = time.perf_counter()
        cross = model.cross_kv(model.encode(tokens, mask))
        t0 = self._tick(stages, "encoder", t0, dev)
        L, H, d = cfg.decoder_layers, cfg.num_heads, cfg.d_kv
        dtype = model.shared.weight.dtype
        # Self K/V [positions, layers, rows, heads, d], one buffer for the whole search: each
        # step writes its rows' K/V at its position and they stay there; ``anc[p, i]`` is the
        # row at position p of row i's ancestor (parent pointers), so compaction moves indices,
        # not K/V (the copies of every earlier position for the survivors cost ~0.24 ms per
        # gen-ref batch of 32 on the H200).
        rows = R * max([1] + list(w_steps[:-1]))  # the most rows any step decodes
        K = torch.empty(depth, L, rows, H, d, dtype=dtype, device=dev)
        V = torch.empty_like(K)
        anc = torch.zeros(max(depth - 1, 1), rows, dtype=torch.long, device=dev)
        beams = 1
        scores = torch.zeros(R, 1, device=dev)
        nodes = torch.zeros(R, 1, dtype=torch.long, device=dev)
        step_tok = torch.full((R, 1), cfg.decoder_start_token_id, dtype=torch.long, device=dev)
        codes = torch.zeros(R, 1, 0, dtype=torch.long, device=dev)
        for t in range(depth):
            logp = model.decode_step(step_tok.view(-1), t, K, V, cross, mask, beams, anc)
            t0 = self._tick(stages, "decoder", t0, dev)
            off = trie.level_offset[t]
            w_next = w_steps[t]
            # Each live beam's trie children only (an illegal SID is not representable), the
            # request's top w_next over beams x children, best first (kernels/trie_topk.py:
            # Numba CUDA on the GPU, its torch reference elsewhere).
            ptr, child_codes = trie.tables(t, dev)
            top, parent, nodes, code = trie_topk(scores, nodes, logp, ptr, child_codes, off,
                                                 trie.max_fanout[t], w_next, cap[:, t])
            t0 = self._tick(stages, "selection", t0, dev)
            if t + 1 < depth:  # compaction: the survivors' ancestors' rows, per position
                src = (torch.arange(R, device=dev)[:, None] * beams + parent).view(-1)
                n = src.shape[0]
                anc[:t, :n] = anc[:t, src]  # (the right side is a copy: no aliasing)
                anc[t, :n] = src
            codes = torch.cat([codes.gather(1, parent[:, :, None].expand(-1, -1, t)),
                               code[:, :, None]], dim=2)
            step_tok = off + code
            scores, beams = top, w_next
            t0 = self._tick(stages, "compaction", t0, dev)
        return scores, nodes, codes

    @torch.inference_mode()
    def submit(self, reqs: list[BeamRequest]) -> "Submitted":
        """Start a batch: the search is queued on the device and its final beams are copied to
        pinned host memory behind it, with an event after the copy. Nothing here waits on the
        device, so the next batch can be submitted while this one runs."""
        dev = self.model.shared.weight.device
        stages: dict[str, float] = {}
        w_steps = self.step_widths([r.widths for r in reqs])
        t0 = time.perf_counter()
        out = start = None
        if dev.type == "cuda":  # the batch's GPU time: from here to ``event`` (its stream
            start = torch.cuda.Event(enable_timing=True)  # reaches it after the batch before)
            start.record()
        if self.plans is not None and dev.type == "cuda" and not self.sync:
            out = self.plans.run(self, reqs, w_steps)
            self._tick(stages, "plan", t0, dev)
        if out is None:  # no plans here, or they are off
            tokens, mask, cap = (x.to(dev) for x in self.inputs(reqs))
            out = self.search(tokens, mask, cap, w_steps, stages)
        event = None
        if dev.type == "cuda":  # copied now, so a later replay of the same plan cannot clobber
            host = tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in out)
            for h, x in zip(host, out):
                h.copy_(x, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            out = host
        return Submitted(reqs, out, event, stages, start)

    def finish(self, sub: "Submitted") -> list[BeamResult]:
        """Wait for a submitted batch's beams (its event only, not later batches' work) and
        build each request's answer."""
        t0 = time.perf_counter()
        if sub.event is not None:
            sub.event.synchronize()
            if sub.start is not None:
                sub.stages["gpu"] = sub.start.elapsed_time(sub.event)
        scores_h, nodes_h, codes_h = (x.numpy() for x in sub.beams)
        stages = sub.stages
        t0 = self._tick(stages, "readback", t0, torch.device("cpu"))
        answers = self.answer_batch(scores_h[:len(sub.reqs)], nodes_h[:len(sub.reqs)],
                                    codes_h[:len(sub.reqs)], [r.top_k for r in sub.reqs],
                                    [r.exclude for r in sub.reqs],
                                    [r.max_per_prefix for r in sub.reqs])
        out = [BeamResult(*a, stages) for a in answers]
        self._tick(stages, "answer", t0, torch.device("cpu"))
        return out

    def run(self, reqs: list[BeamRequest]) -> list[BeamResult]:
        return self.finish(self.submit(reqs))

    def answer_batch(self, scores: np.ndarray, nodes: np.ndarray, codes: np.ndarray,
                     top_ks: list[int], exclude: list | None = None,
                     max_per_prefix: list[int] | None = None) -> list[tuple[list, list, list]]:
        """Every request's answer at once (``answer`` row by row, as flat arrays: one
        ``tolist`` per output for the whole batch instead of three per request), after the
        selection variants (``runtime/variants.py``) where a request asks for them."""
        R, W = scores.shape
        if R == 0:
            return []
        filtered = ((exclude and any(e is not None for e in exclude))
                    or (max_per_prefix and any(max_per_prefix)))
        # Unfiltered, the first max(top_k) beams hold every row's answer: beams are sorted
        # best first and a live beam is a leaf with an item at least (SidTrie and trie_without
        # keep no empty leaf), so beams of 1,024 for 256 items read 256.
        if not filtered and max(top_ks) < W:
            W = max(top_ks)
            scores, nodes, codes = scores[:, :W], nodes[:, :W], codes[:, :W]
        live = np.isfinite(scores)  # sorted best first: -inf beams trail
        lo = self.trie.leaf_ptr[nodes]
        n = np.ones_like(lo) if self.policy == "first" else self.trie.leaf_ptr[nodes + 1] - lo
        n = np.where(live, n, 0).reshape(-1)
        beam = np.repeat(np.arange(R * W), n)  # flat (row, beam) of each item, in order
        starts = np.cumsum(n) - n
        pos = lo.reshape(-1)[beam] + np.arange(len(beam)) - starts[beam]
        row = beam // W
        if filtered:
            ok = keep_mask(row, self.trie.leaf_items[pos], codes.reshape(R * W, -1)[beam, 0],
                           exclude or [None] * R, max_per_prefix or [0] * R)
            beam, pos, row = beam[ok], pos[ok], row[ok]
        row_start = np.searchsorted(row, np.arange(R))  # items of a row are contiguous
        keep = (np.arange(len(beam)) - row_start[row]) < np.asarray(top_ks)[row]
        beam, pos, row = beam[keep], pos[keep], row[keep]
        items = self.trie.leaf_items[pos].tolist()
        sc = scores.reshape(-1)[beam].astype(float).tolist()
        # lists only when read (SidRows); a gather is a copy, so the answers never see the
        # readback buffer the next batches reuse
        sids = codes.reshape(R * W, -1)[beam]
        bounds = np.searchsorted(row, np.arange(R + 1)).tolist()
        return [(items[a:b], sc[a:b], SidRows(sids[a:b]))
                for a, b in zip(bounds[:-1], bounds[1:])]

    def answer(self, scores: np.ndarray, nodes: np.ndarray, codes: np.ndarray, top_k: int):
        """One request's final beams (best first) -> its top-k (items, scores, SIDs): each
        beam's items in catalog order (all, or the first, per the SID policy), array-wise."""
        live = int(np.isfinite(scores).sum())  # sorted best first: -inf beams trail
        leaf = nodes[:live]
        lo = self.trie.leaf_ptr[leaf]
        n = np.ones_like(lo) if self.policy == "first" else self.trie.leaf_ptr[leaf + 1] - lo
        beam = np.repeat(np.arange(live), n)[:top_k]
        starts = np.cumsum(n) - n
        pos = lo[beam] + np.arange(len(beam)) - starts[beam]
        return (self.trie.leaf_items[pos].tolist(), scores[beam].astype(float).tolist(),
                codes[beam].tolist())
