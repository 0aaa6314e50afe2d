"""Rank plans: a rank batch's whole HSTU forward captured as CUDA graphs per bucketed shape.

A cached rank batch issues ~20 device ops per layer from Python; on a batch of one user that
host work, not the GPU, sets the latency. A plan captures the forward (embedding, every layer's
projection, paged append, attention and glue, the head) once per shape bucket and replays it:
the batch's token ids, positions, candidate rows, append slots and attention work items are
written into the plan's pinned buffer, and the first graph copies them into its static device
buffers (one host-to-device copy), embeds and runs the first layer while the host launches the
second graph, the other layers and the head. Shapes are bucketed (rows, candidates, append
slots, attention items, pages, merge rows, workspace), padding rows belong to no user (row-local
ops compute garbage there that nothing reads), padding append slots have page -1 and padding
attention items belong to an empty user, so padding never changes a result: a replayed batch
equals its eager run bit for bit. Batches that onload host chunks stay eager (their per-layer
onload events are not part of a graph). Plans live in an LRU over one shared memory pool; new
weights drop them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ..kernels import hstu_attention_cuda as attn_cuda
from ..kernels import hstu_plan, paged_kv
from ..models.hstu import JaggedBatch

log = logging.getLogger("streamgr.engine")

MAX_ROWS = 16384  # larger batches (long recomputes) are GPU-bound: eager


def _up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def row_bucket(n: int) -> int:
    return _up(n, 256) if n <= 4096 else _up(n, 1024)


@dataclass
class HostBatch:
    """One batch as host arrays: what a plan's static buffers receive."""

    packed: np.ndarray  # int64 [3, rows]: token ids, is_action, positions
    cand_rows: np.ndarray  # int64 [candidates]
    app_rows: np.ndarray  # int64 [appends]: rows of k/v whose K/V go to pages
    app_pages: np.ndarray
    app_offsets: np.ndarray


class _Entry:
    def __init__(self, key, rows, cands, apps, caps, splits, device, max_rows):
        # caps, splits: of the plan of every layer but the last, then (or None: the same plan)
        # of the last layer's (its row tiles that hold a candidate only)
        self.key, self.rows, self.cands, self.apps, self.caps = key, rows, cands, apps, caps
        self.n64 = 3 * rows + cands + 3 * apps
        n32 = [sum(c.sizes) if c is not None else 0 for c in caps]
        self.n32 = sum(n32)
        # One pinned buffer and one device buffer, int64 then int32 views: one copy per batch
        nbytes = 8 * self.n64 + 4 * self.n32
        self.host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host64, self.host32 = (self.host[:8 * self.n64].view(torch.int64),
                                    self.host[8 * self.n64:].view(torch.int32))
        self.dev64, self.dev32 = (self.dev[:8 * self.n64].view(torch.int64),
                                  self.dev[8 * self.n64:].view(torch.int32))
        d = self.dev64
        self.ids, self.act, self.pos = d[:rows], d[rows:2 * rows], d[2 * rows:3 * rows]
        o = 3 * rows
        self.cand_rows = d[o:o + cands]
        o += cands
        self.app_rows, self.app_p, self.app_o = (d[o:o + apps], d[o + apps:o + 2 * apps],
                                                 d[o + 2 * apps:o + 3 * apps])
        self.plan = attn_cuda.static_plan(splits[0], caps[0], self.dev32[:n32[0]], max_rows)
        self.last = self.plan if caps[1] is None else attn_cuda.static_plan(
            splits[1], caps[1], self.dev32[n32[0]:], max_rows)
        # The forward as two graphs: the batch's copy into ``dev``, the embedding and the first
        # layer, then the rest (``mid``: the first's output, the second's input).
        self.graphs: tuple = ()
        self.mid: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.copied = torch.cuda.Event()  # the last fill's copy out of ``host`` (one event, reused)
        self.filled = False

    def fill(self, hb: HostBatch, hps: tuple) -> None:
        """The batch into the pinned buffer; before the capture, also its copy to ``dev`` (the
        captured first graph copies it itself: one host call fewer a batch)."""
        if self.filled:  # with batches in flight, the last copy may not have run
            self.copied.synchronize()
        h = self.host64.numpy()
        rows, n = self.rows, hb.packed.shape[1]
        for i in range(3):
            h[i * rows:i * rows + n] = hb.packed[i]
            h[i * rows + n:(i + 1) * rows] = 0
        o = 3 * rows
        c = len(hb.cand_rows)
        h[o:o + c] = hb.cand_rows
        h[o + c:o + self.cands] = 0
        o += self.cands
        a, A = len(hb.app_rows), self.apps
        for arr, fill in ((hb.app_rows, 0), (hb.app_pages, -1), (hb.app_offsets, 0)):
            h[o:o + a] = arr
            h[o + a:o + A] = fill
            o += A
        h32, o = self.host32.numpy(), 0
        for hp, cap in zip(hps, self.caps):
            if cap is not None:
                hstu_plan.pad_plan(hp, cap, h32[o:o + sum(cap.sizes)])
                o += sum(cap.sizes)
        if not self.graphs:
            self.dev.copy_(self.host, non_blocking=True)
            self.copied.record()
        self.filled = True

    def replay(self) -> None:
        """The first graph, then the second: the GPU starts on the first (a dozen nodes) while
        the host still launches the second (the other ~60), instead of idling through the
        launch of one graph of them all (76 us of host time on the H200's host, session 63)."""
        first, rest = self.graphs
        first.replay()
        self.copied.record()  # (the copy is the first graph's first node)
        rest.replay()


class RankPlans:
    """The LRU of captured rank forwards of one model (and page store, for cached modes)."""

    def __init__(self, model, max_batch: int, capacity: int, store: torch.Tensor | None,
                 page_tokens: int, device: torch.device) -> None:
        self.model, self.max_batch, self.capacity = model, max_batch, capacity
        self.store, self.page_tokens, self.device = store, page_tokens, device
        self.entries: OrderedDict = OrderedDict()
        self.pool = None
        self.counters = {"replays": 0, "captures": 0, "evictions": 0, "capture_failures": 0}
        self._broken: set = set()
        self._sms: int | None = None
        # Every page a batch can name: max_batch users of the longest history.
        self.max_pages = max_batch * (-(-(2 * model.cfg.max_history) // page_tokens) + 1)
        self._ws: dict[int, torch.Tensor] = {}  # slots -> workspace shared by plans (never
        # two replays at once); a plan keeps the tensor it was captured with

    @staticmethod
    def usable(model, device: torch.device) -> bool:
        """The plans' kernels run here: CUDA, CuPy, bf16 weights, a head dim they take."""
        from ..kernels import _cuda
        w = model.layers[0].uvqk.weight
        return (device.type == "cuda" and w.dtype == torch.bfloat16
                and model.cfg.head_dim in (32, 64, 128) and _cuda.usable(w))

    def _workspace(self, slots: int) -> torch.Tensor:
        ws = self._ws.get(slots)
        if ws is None:
            cfg = self.model.cfg
            ws = self._ws[slots] = torch.empty(slots * cfg.num_heads * attn_cuda.SR * cfg.head_dim,
                                               dtype=torch.float32, device=self.device)
        return ws

    def clear(self, model=None) -> None:
        """Drop every plan (new weights: the graphs hold the old tensors' addresses)."""
        self.entries.clear()
        self._broken.clear()
        self._ws.clear()
        # The dropped graphs released their pool; capturing into its id again failed an
        # allocator assert (use_count > 0) on the first capture after each rank refit.
        self.pool = None
        if model is not None:
            self.model = model

    def stats(self) -> dict:
        return {"plans": len(self.entries), **self.counters}

    def run(self, hb: HostBatch, desc, stages: dict | None = None) -> torch.Tensor | None:
        """The batch's scores ``[candidates]`` (device fp32) from a plan, or None when this
        batch cannot replay (too large, or its capture failed before): run it eagerly.
        ``stages`` (ms) gets the host time of a replay's steps: ``plan`` (the attention work
        items), ``fill`` (the pinned buffer; before a capture also its copy), ``launch`` (the
        two graphs)."""
        t0 = time.perf_counter()
        rows, cands = hb.packed.shape[1], len(hb.cand_rows)
        if rows > MAX_ROWS or len(desc.num_candidates) > self.max_batch:
            return None
        cfg = self.model.cfg
        if self._sms is None:
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        hps = attn_cuda.plan_pair(desc, self.device, cfg.num_heads, cfg.head_dim, self._sms)
        hp = hps[0]
        if len(hp.pages) > self.max_pages:
            return None
        # Floors and fixed sizes that keep one batch size's shapes few: an empty padding item
        # costs a block that returns at once.
        caps = tuple(None if p is None else hstu_plan.Capacity(
            items=_pow2(len(p.items[0]), 512), users=self.max_batch, pages=self.max_pages,
            fin=_pow2(len(p.fin[0]), 64), slots=_pow2(p.n_slots, 512)) for p in hps)
        splits = tuple(p is not None and p.split for p in hps)
        rb = row_bucket(rows)
        key = (rb, _up(cands, 256), hp.max_rows, splits) + tuple(
            (c.items, c.fin, c.slots) if c is not None else None for c in caps)
        if key in self._broken:
            return None
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            t1 = time.perf_counter()
            entry.fill(hb, hps)
            t2 = time.perf_counter()
            entry.replay()
            self.counters["replays"] += 1
            if stages is not None:
                for name, dt in (("plan", t1 - t0), ("fill", t2 - t1),
                                 ("launch", time.perf_counter() - t2)):
                    stages[name] = stages.get(name, 0.0) + dt * 1e3
            return entry.scores[:cands]
        apps_cap = rb if self.store is not None else 0  # recompute appends nothing
        entry = _Entry(key, rb, key[1], apps_cap, caps, splits, self.device, hp.max_rows)
        # one workspace for both plans: the layers run one after another on one stream
        ws = self._workspace(max(c.slots for c in caps if c is not None))
        for p in (entry.plan, entry.last):
            p.workspace[(cfg.num_heads, cfg.head_dim, self.device)] = ws
        entry.fill(hb, hps)
        try:
            self._capture(entry)
        except Exception as err:  # the batch still runs, eagerly; this shape stays eager
            log.warning("rank plan capture failed for shape %s (%s); eager from now on", key, err)
            self.counters["capture_failures"] += 1
            self._broken.add(key)
            self.pool = None  # a failed capture can leave its pool mid-recording
            torch.cuda.synchronize(self.device)
            return None
        self.entries[key] = entry
        self.counters["captures"] += 1
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
            self.counters["evictions"] += 1
        entry.replay()
        self.counters["replays"] += 1
        return entry.scores[:cands]

    def _forward(self, e: _Entry, part: int | None = None) -> torch.Tensor:
        """The plan's forward over its static buffers: whole (``part`` None), or its first
        layers from the batch's copy on (0) or the rest from ``e.mid`` on (1)."""
        cfg = self.model.cfg
        if part == 0:  # first: everything below reads what it copies
            e.dev.copy_(e.host, non_blocking=True)
        # (the rest reads no is_action: no conversion kernel in its graph)
        jb = JaggedBatch(token_ids=e.ids, is_action=e.act if part == 1 else e.act.bool(),
                         positions=e.pos, candidate_rows=e.cand_rows, q_offsets=[],
                         num_candidates=[], hist_lens=[])
        where = SimpleNamespace(store=self.store, page_tokens=self.page_tokens)
        store = self.store

        def attention(layer, q, k, v):
            if e.apps:
                paged_kv.append_rows(store, layer, k, v, e.app_rows, e.app_p, e.app_o)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            plan = e.last if cfg.is_last(layer) else e.plan
            attn_cuda.run(q, k, v, where, layer, cfg.alpha, cfg.attn_max_len, out, plan)
            return out
        if part is None:
            return self.model(jb, attention)
        first = 1 if len(self.model.layers) > 1 else 0
        if part == 1:
            return self.model.score(self.model.run_layers(e.mid, jb, attention, first,
                                                          len(self.model.layers)))
        with torch.inference_mode():
            return self.model.run_layers(self.model.embed(jb), jb, attention, 0, first)

    def _capture(self, e: _Entry) -> None:
        # One eager run on a side stream first: kernels compile, workspaces and cuBLAS handles
        # are made outside the capture (what it computes is what the replay computes again).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(e)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graphs = (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
        # thread_local: the offload and onload threads keep using their own streams meanwhile;
        # the default (global) mode lets their CUDA calls invalidate this capture.
        with torch.cuda.graph(graphs[0], pool=self.pool, capture_error_mode="thread_local"):
            e.mid = self._forward(e, 0)
        with torch.cuda.graph(graphs[1], pool=self.pool, capture_error_mode="thread_local"):
            e.scores = self._forward(e, 1)
        e.graphs = graphs
