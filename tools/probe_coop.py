"""What a one-launch grid selection could save: in-graph costs of the pieces around the grid
path's work (``trie_topk_bins``), measured on the GPU.

- an empty Numba kernel (one block; the floor of a graph's kernel node),
- two dependent launches of a 96 x 1,024 grid (the grid path's ``bin_hist`` then
  ``bin_select`` shape at step 2) against one cooperative launch with a ``grid.sync()``
  between the same two halves (Numba launches a kernel that calls ``cuda.cg.this_grid()``
  cooperatively; whether a CUDA graph captures that launch is the first question),
- ``torch.zeros`` of the grid path's workspace (an allocation and a fill node).

    python3 tools/probe_coop.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from graph_timing import graph_ms  # noqa: E402
from streamgr.kernels.numba_common import as_array, torch_stream  # noqa: E402


@cuda.jit
def empty(x):
    if cuda.threadIdx.x == 1 << 20:
        x[0] = 1


@cuda.jit
def half(x, n, phase):
    i = cuda.grid(1)
    if i < n:
        x[i] = x[i] * 2 + phase


@cuda.jit
def both(x, n):
    g = cuda.cg.this_grid()
    i = cuda.grid(1)
    if i < n:
        x[i] = x[i] * 2
    g.sync()
    j = n - 1 - i
    if 0 <= j < n:
        x[j] = x[j] * 2 + 1


def main() -> None:
    dev = torch.device("cuda")
    blocks, nt = 96, 1024
    x = torch.zeros(blocks * nt, dtype=torch.int32, device=dev)
    xa = as_array(x)
    n = x.numel()

    def one_empty():
        empty[1, 32, torch_stream(dev)](xa)

    def two():
        s = torch_stream(dev)
        half[blocks, nt, s](xa, n, 0)
        half[blocks, nt, s](xa, n, 1)

    def coop():
        both[blocks, nt, torch_stream(dev)](xa, n)

    def zeros():
        return torch.zeros(16, 4104, dtype=torch.int64, device=dev)

    rows = [("empty kernel, 1 block", one_empty), ("two launches 96 x 1,024", two),
            ("one cooperative launch, grid.sync", coop), ("torch.zeros [16, 4104] int64", zeros)]
    for name, fn in rows:
        try:
            ms = graph_ms(fn)
            print(f"{name:>40}: {1000 * ms:8.2f} us", flush=True)
        except Exception as err:  # the capture (or the launch) refused
            print(f"{name:>40}: failed: {type(err).__name__}: {err}", flush=True)
    # correctness of the cooperative launch: every element doubled (1 -> 2), then, after the
    # grid-wide barrier, doubled plus one by another thread (2 -> 5)
    x.fill_(1)
    coop()
    torch.cuda.synchronize()
    print("cooperative result ok:", bool((x == 5).all().item()))


if __name__ == "__main__":
    main()
