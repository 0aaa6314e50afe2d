"""Decode plans: each batch shape's whole beam search captured once as a CUDA graph, replayed.

RecoGEM builds a plan per decoding step so that a step costs one launch, not hundreds. Here the
search (encoder, and per step decoder, trie-child selection, top-k and compaction) has static
shapes once the batch's rows, encoder length and step widths are fixed, and it never waits on
the device; so ``BeamSearch.search`` is captured whole, per shape, and a batch costs a copy of
its inputs, one graph launch and a read-back. In eager mode the same batch is ~1,000 kernel
launches from Python, which made the host, not the device, the bound (docs/benchmarks.md).

Shapes are bucketed so a few plans serve all traffic: rows to a power of two or 1.5x one (or
the engine's ``max_batch``; ``bucket_rows``), idle rows given one EOS token and width 0 (their
beams are -inf from the first step and cannot reach the answer); encoder length to a multiple of ``length_step`` (the last
bucket ending at the longest context the policy allows), the padding masked. A request's
result does not depend on its neighbours, so the padding changes nothing.

Plans live in an LRU of ``max_plans``; all share one memory pool. That is safe because plans
run one at a time on the engine's executor thread and each replay's outputs are read back
before the next replay: a plan's intermediates are dead between its replays. A graph holds its
tensors' addresses, so each generate version (weights, catalog, policy) has its own PlanCache
(``engine/generate.py``); a new version captures the shapes the traffic uses before it serves.
A capture that fails (an op that cannot be captured on some build) turns plans off, with a
warning, and the search runs eagerly from then on.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict

import torch

from ..kernels.counters import Counters

# Encoder lengths are padded (masked keys) to a multiple of this: the fused attention kernel
# wants its bias rows aligned so, and would otherwise pad a copy of the bias at every call.
LENGTH_ALIGN = 16


def aligned_length(n: int) -> int:
    return -(-n // LENGTH_ALIGN) * LENGTH_ALIGN


def bucket_rows(n: int, max_rows: int) -> int:
    """The plan rows for a batch of ``n`` requests: the next of 1, 2, 4, 8, 12, 16, 24, 32,
    48, ... (powers of two and, from 12, 1.5x them), capped at ``max_rows`` (or ``n`` past
    it). The padding rows cost what real ones do: with powers of two alone a batch of 17 ran
    as 32 (an open loop's batches take what arrived, so most are not a power of two); here
    past 8 rows less than a third of a plan is padding, for two more plans up to 32 rows."""
    b = 1
    while b < n:
        if b < 8:
            b *= 2
        else:  # 8 -> 12 -> 16 -> 24 -> 32 -> 48 ...
            b = b + b // 2 if b & (b - 1) == 0 else b // 3 * 4
    return min(b, max(max_rows, n))


class DecodePlan:
    """One captured search: static inputs (tokens, mask, widths) and outputs."""

    def __init__(self, search, rows: int, length: int, w_steps: tuple[int, ...], pool) -> None:
        dev = search.model.shared.weight.device
        self.tokens = torch.zeros(rows, length, dtype=torch.long, device=dev)
        self.mask = torch.zeros(rows, length, dtype=torch.bool, device=dev)
        self.cap = torch.zeros(rows, search.trie.depth, dtype=torch.long, device=dev)
        self.mask[:, 0] = True
        # Warm-up off the capturing stream: first calls set up library handles, workspaces and
        # the trie's device tables, none of which may happen inside a capture.
        # The warm-up also sizes the plan's own selection counters (zeroed once here, outside
        # the shared pool; the kernels leave them zero, so the graph holds no fill for them).
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        self.counters = Counters()
        with torch.cuda.stream(side), self.counters.sizing():
            search.search(self.tokens, self.mask, self.cap, w_steps)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.counters.allocate(dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"), \
                self.counters.serving():
            self.out = search.search(self.tokens, self.mask, self.cap, w_steps)
        # Two pinned staging sets, used in turn: a batch's inputs are packed straight into
        # one (no per-batch pinned allocation, a visible host cost per batch in the H200
        # profiles) while the other may still be in its copy.
        self._host = [tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                            for x in (self.tokens, self.mask, self.cap)) for _ in range(2)]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def replay(self, search, reqs):
        """Pack ``reqs`` into a staging set, copy it in, launch the graph (nothing waits on
        the device, unless the set's copy of two replays ago has not run yet)."""
        i, self._turn = self._turn, self._turn ^ 1
        self._copied[i].synchronize()  # a never-recorded event is complete
        rows, length = self.tokens.shape
        host = search.inputs(reqs, rows, length, out=self._host[i])
        for dev, h in zip((self.tokens, self.mask, self.cap), host):
            dev.copy_(h, non_blocking=True)
        self._copied[i].record()
        self.graph.replay()
        return self.out


class PlanCache:
    def __init__(self, max_rows: int, max_plans: int = 16, length_step: int = 64,
                 max_length: int | None = None) -> None:
        self.max_rows, self.max_plans, self.length_step = max_rows, max_plans, length_step
        # The longest context a request can have (the policy's): the last length bucket ends
        # there (aligned for the attention kernels) instead of at the next multiple of
        # length_step. Full histories are the common case: gen-ref's 769 tokens run at 784
        # instead of 832 (attention ~S^2: ~11% less encoder attention), with no extra bucket.
        self.cap = None if max_length is None else aligned_length(max_length)
        self.plans: OrderedDict[tuple, DecodePlan] = OrderedDict()
        self.enabled = True
        self.captures = 0
        self.replays = 0
        self._pool = None
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self.plans.clear()

    def keys(self) -> list[tuple]:
        """The shapes captured, least recently used first."""
        with self._lock:
            return list(self.plans)

    def capture(self, search, key) -> bool:
        """Capture ``key``'s plan now (a new version's warm-up); False when plans are off."""
        with self._lock:
            return self._plan(search, key) is not None

    def key(self, reqs, w_steps) -> tuple[int, int, tuple[int, ...]]:
        longest = max(len(r.context) for r in reqs)
        length = -(-longest // self.length_step) * self.length_step
        if self.cap is not None and longest <= self.cap:
            length = min(length, self.cap)
        return bucket_rows(len(reqs), self.max_rows), length, w_steps

    def _plan(self, search, key) -> DecodePlan | None:
        """The shape's plan, captured on first sight; None once plans are off."""
        plan = self.plans.get(key) if self.enabled else None
        if plan is None and self.enabled:
            try:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                plan = DecodePlan(search, *key, self._pool)
                self.captures += 1
                self.plans[key] = plan
                while len(self.plans) > self.max_plans:
                    self.plans.popitem(last=False)
            except Exception as e:  # noqa: BLE001 - any capture failure: search eagerly
                self.enabled = False
                self.plans.clear()
                warnings.warn(f"decode plans off, searching eagerly: capture failed: {e!r}")
                return None
        self.plans.move_to_end(key)
        return plan

    def run(self, search, reqs, w_steps):
        """The batch through its shape's plan: the final beams (scores, nodes, codes) of its
        rows, as views of the plan's outputs, valid until the plan's next replay (the caller
        copies them behind the replay, in stream order). None when plans are off: the caller
        searches eagerly."""
        with self._lock:
            key = self.key(reqs, w_steps)
            plan = self._plan(search, key)
            if plan is None:
                return None
            self.replays += 1
            return tuple(x[:len(reqs)] for x in plan.replay(search, reqs))

    def stats(self) -> dict:
        return {"plans": len(self.plans), "captures": self.captures, "replays": self.replays,
                "enabled": self.enabled}
