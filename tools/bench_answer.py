"""Answer assembly of generate on the host (CPU): a batch of 16 requests x 256 final beams over a
gen-ref-sized trie (1,000,000 items, codebooks 8,192^3) turned into items, scores and SIDs, row
by row (``BeamSearch.answer``, SIDs as lists) against the batch-wide ``answer_batch`` (SIDs as
``SidRows``: lists only when read), and that with every answer's SID lists read; checks they
are equal, then prints the median time per batch (30 runs, garbage collection off).

    python tools/bench_answer.py
    python tools/bench_answer.py --requests 48 --beams 1024 --top-k 256   # wide beams
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from streamgr.runtime.beam import BeamSearch  # noqa: E402
from streamgr.selection.vocabulary import SidTrie  # noqa: E402
from streamgr.selection.catalog import random_catalog  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--beams", type=int, default=256, help="final beams a request")
    ap.add_argument("--top-k", type=int, default=256, help="items a request")
    args = ap.parse_args()
    trie = SidTrie(random_catalog(1_000_000, [8192] * 3, seed=1), [8192] * 3, 3)
    bs = BeamSearch.__new__(BeamSearch)
    bs.trie, bs.policy = trie, "all"
    rng = np.random.default_rng(0)
    R, W = args.requests, args.beams
    leaves = rng.integers(0, len(trie.leaf_ptr) - 1, size=(R, W))
    scores = -np.sort(rng.random((R, W)).astype(np.float32), axis=1)
    codes = trie.leaf_sids[leaves]
    ks = [args.top_k] * R
    rows = lambda: [bs.answer(scores[i], leaves[i], codes[i], k) for i, k in enumerate(ks)]  # noqa: E731
    batch = lambda: bs.answer_batch(scores, leaves, codes, ks)  # noqa: E731
    read = lambda: [a[2].tolist() for a in batch()]  # noqa: E731
    assert rows() == batch()
    gc.disable()
    out = {}
    for name, fn in (("row by row", rows), ("batch", batch), ("batch, SIDs read", read)):
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = float(np.median(ts)) * 1e3
        print(f"{name:>16}: {out[name]:.3f} ms per batch of {R} x {W}")
    print(f"bench_answer: batch {out['batch']:.3f} ms ({out['batch, SIDs read']:.3f} with every "
          f"SID list read) vs row by row {out['row by row']:.3f} ms")


if __name__ == "__main__":
    main()
