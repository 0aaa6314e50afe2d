"""The generate engine's host path alone: gen-ref's requests (256-item histories, a
million-item catalog, top 256 of 256 beams) through a started engine whose device work is
replaced by canned final beams, so that what is timed is everything else: preparation, the
batcher, the batch loop, the executor and completion threads, answer assembly, the futures.
Closed loop; prints requests/s and the CPU time per request of the event loop and of the
whole process (the batch, executor and completion threads share the GIL with the loop). If this rate is far
above a GPU run's, the GPU (and the pipeline around it), not the host, bounds that run.

  python tools/probe_gen_host.py --requests 6400
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr import Engine  # noqa: E402
from streamgr.api import GenerateRequest  # noqa: E402
from streamgr.runtime.beam import BeamResult  # noqa: E402
from streamgr.server.main import run as run_loop  # noqa: E402

# gen-ref's catalog, policy and batching; a model too small to matter (it is never run).
TINY = {"engine.device": "cpu", "model.num_layers": 1, "model.num_decoder_layers": 1,
        "model.model_dim": 16, "model.num_heads": 1, "model.head_dim": 16, "model.d_ff": 16,
        "model.dtype": "float32", "engine.refit_spare": False}


def stub_device(eng, rng) -> None:
    """The active version's search answers from canned beams (random leaves, sorted scores)."""
    v = eng.gen_runner.active
    R, W = eng.spec.engine.max_batch, max(v.policy.beam_widths)
    leaf = rng.integers(0, len(v.trie.leaf_ptr) - 1, size=(R, W))
    scores = np.sort(rng.normal(size=(R, W)).astype(np.float32), axis=1)[:, ::-1].copy()
    codes = rng.integers(0, 256, size=(R, W, v.trie.depth))

    def finish(reqs):
        n = len(reqs)
        ans = v.search.answer_batch(scores[:n], leaf[:n], codes[:n], [r.top_k for r in reqs])
        return [BeamResult(*a, {}) for a in ans]
    v.search.submit, v.search.finish = (lambda reqs: reqs), finish


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6400)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                    help="event loop (auto: uvloop where installed, as `streamgr serve`)")
    a = ap.parse_args()
    eng = Engine.from_spec("gen-ref", TINY)
    rng = np.random.default_rng(0)
    stub_device(eng, rng)
    ids = eng.gen_runner.catalog_items
    reqs = [GenerateRequest(user_id=u, history=rng.choice(ids[:len(ids) // 2], 256).tolist(),
                            top_k=256) for u in range(a.requests)]

    async def run():
        async with eng:
            async def worker(k):
                for r in reqs[k::a.concurrency]:
                    await eng.generate(r)
            await asyncio.gather(*(worker(k) for k in range(a.concurrency)))  # warm
            t, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            await asyncio.gather(*(worker(k) for k in range(a.concurrency)))
            return (time.perf_counter() - t, time.thread_time() - c0,
                    time.process_time() - p0)
    wall, cpu, proc = run_loop(run(), a.loop)
    print(f"probe_gen_host gen-ref: {a.requests / wall:,.0f} requests/s closed loop "
          f"(x{a.concurrency}) with the device work stubbed; event loop CPU "
          f"{cpu / a.requests * 1e6:.0f} us per request, all threads "
          f"{proc / a.requests * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
