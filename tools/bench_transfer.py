"""Transfer benchmark: the onload pipeline against pinned host-to-device bandwidth, and the
scatter/gather kernels against device copy bandwidth (rank-ref's page and chunk sizes).

Targets (issue 4): onload >= 85% of the pinned H2D copy; scatter and gather >= 70% of a
device-to-device copy (bytes read + written). Each path is checked against its reference first.

  python tools/bench_transfer.py [--chunks 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr.cache.store import KVStores  # noqa: E402
from streamgr.kernels import paged_kv  # noqa: E402
from streamgr.streams import OnloadPipeline, StreamSet  # noqa: E402


def cuda_time(fn, reps: int = 10) -> float:
    """Mean seconds of ``fn`` on the current stream, by CUDA events, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_transfer: needs a GPU")
        return 1
    dev = torch.device("cuda")
    L, H, D, P, C = args.layers, 4, 128, 32, 1024
    n = args.chunks
    pages = n * (C // P) + 64
    stores = KVStores(L, H, D, P, C, pages, n, torch.bfloat16, dev)
    stores.host.copy_(torch.randn(stores.host.shape, dtype=torch.bfloat16))
    chunk_bytes = stores.chunk_bytes
    total = n * chunk_bytes

    # Ceiling 1: one pinned host-to-device copy of the same bytes.
    pinned = torch.empty(total // 2, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty(total // 2, dtype=torch.bfloat16, device=dev)
    h2d = total / cuda_time(lambda: dst.copy_(pinned, non_blocking=True))

    # The onload pipeline: host chunk store -> pinned double buffers -> onload buffer -> pages,
    # and with a pinned host store: straight DMA -> onload buffer -> pages.
    streams = StreamSet(dev)
    page_ids = torch.randperm(pages)[:n * (C // P)].tolist()
    jobs = [("u", list(range(n)), page_ids)]
    ids = torch.tensor(page_ids, device=dev)

    def onload_rate(st, layer_group: int = 1) -> float:
        pipe = OnloadPipeline(st, streams)
        pipe.layer_group = layer_group  # (STREAMGR_ONLOAD_LAYERS in the engine)

        def once() -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            pipe.submit(jobs).done()
            torch.cuda.synchronize()
            return time.perf_counter() - t
        once()
        t_on = min(once() for _ in range(3))
        back = paged_kv.offload_gather(st.pages, ids, C // P)  # the pages hold the host chunks
        assert torch.equal(back.cpu(), st.host[:n]), "onload pipeline moved wrong data"
        pipe.close()
        return total / t_on
    onload = onload_rate(stores)
    direct = {}
    # Pinned in 4 KiB or in 2 MiB pages; one layer of a chunk per copy, or all of its layers.
    for label, huge, group in (("4k", False, 1), ("huge", True, 1), ("huge, all layers", True, L)):
        pinned_store = KVStores(L, H, D, P, C, pages, n, torch.bfloat16, dev, host_pinned=True,
                                host_huge_pages=huge)
        pinned_store.host.copy_(stores.host)
        pinned_store.pages.zero_()
        direct[label] = onload_rate(pinned_store, group)
        pinned_store.close()
        del pinned_store
    onload_direct = direct["4k"]

    # Ceiling 2: a device-to-device copy (read + write).
    a = torch.empty(total // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    d2d = 2 * total / cuda_time(lambda: b.copy_(a))

    # Scatter (onload buffer -> pages) and gather (pages -> chunk layout) kernels, all layers.
    buf = stores.host[:n].to(dev)
    ref = stores.pages.clone()
    for layer in range(L):
        ref[layer].index_copy_(0, ids, buf[:, layer].reshape(-1, *stores.pages.shape[2:]))
    t_sc = cuda_time(lambda: [paged_kv.onload_scatter(stores.pages, layer, buf, ids)
                              for layer in range(L)])
    assert torch.equal(stores.pages, ref), "scatter kernel differs from the reference"
    out = torch.empty_like(buf)
    t_ga = cuda_time(lambda: paged_kv.offload_gather(stores.pages, ids, C // P, out=out))
    assert torch.equal(out, buf), "gather kernel differs from the reference"
    scatter, gather = 2 * total / t_sc, 2 * total / t_ga

    gb = lambda x: x / 1e9  # noqa: E731
    print(f"{n} chunks x {chunk_bytes / 2**20:.0f} MiB ({L} layers, page {P}, chunk {C}): "
          f"{total / 2**30:.2f} GiB")
    print(f"{'path':<40} {'GB/s':>8} {'ceiling GB/s':>13} {'ratio':>7} {'target':>7}")
    rows = [("onload, staged (pageable host store)", onload, h2d, 0.85),
            ("onload, direct (pinned host store)", onload_direct, h2d, 0.85),
            ("  same, store in huge pages", direct["huge"], h2d, 0.85),
            ("  same, all layers of a chunk per copy", direct["huge, all layers"], h2d, 0.85),
            ("scatter kernel (read+write)", scatter, d2d, 0.70),
            ("gather kernel (read+write)", gather, d2d, 0.70)]
    for name, x, ceil, target in rows:
        print(f"{name:<40} {gb(x):>8.1f} {gb(ceil):>13.1f} {x / ceil:>7.1%} {target:>7.0%}")
    print(f"bench_transfer: onload staged {onload / h2d:.0%}, direct {onload_direct / h2d:.0%} "
          f"({gb(onload):.1f}/{gb(onload_direct):.1f} GB/s) of pinned H2D "
          f"{gb(h2d):.1f} GB/s; scatter {scatter / d2d:.0%}, gather {gather / d2d:.0%} of D2D "
          f"{gb(d2d):.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
