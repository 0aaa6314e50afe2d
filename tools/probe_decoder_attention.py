"""Times the decoder self-attention kernel (Numba) against its torch reference on gen-ref's
step shapes (4,096 beams x 8 heads x 64, positions 1..3), CUDA-graph replays, with earlier
positions read through random parent pointers as the search serves them (``--aligned``: each
row's own, the layout before parent pointers; ``--fused``: q, k, v as column slices of one
q|k|v GEMM's output, as the fused projections give them); run under ``ncu --kernel-name regex:kernel`` to
see why it runs as it does."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr.kernels.decoder_attention import self_attend  # noqa: E402
from tools.graph_timing import graph_ms  # noqa: E402


def main() -> int:
    dev, bf = torch.device("cuda"), torch.bfloat16
    N, H, d, L, T = 4096, 8, 64, 4, 3
    K = torch.randn(T, L, N, H, d, device=dev).to(bf)
    V = torch.randn_like(K)
    if "--fused" in sys.argv:
        qkv = torch.randn(N, 3 * H * d, device=dev).to(bf)
        q, kn, vn = (t.view(N, H, d) for t in qkv.chunk(3, dim=-1))
    else:
        q, kn, vn = (torch.randn(N, H, d, device=dev).to(bf) for _ in range(3))
    bias = torch.randn(T, H, device=dev)
    anc = None if "--aligned" in sys.argv else torch.randint(0, N, (T - 1, N), device=dev)
    for step in range(T):
        row = []
        for impl in ("numba", "torch"):
            ms = graph_ms(lambda: self_attend(q, kn, vn, K[:, 1], V[:, 1], step,
                                              bias[:step + 1], anc, impl=impl), reps=10)
            row.append(ms)
        byts = (2 * (step + 1) + 3) * N * H * d * 2
        print(f"step {step}: numba {row[0] * 1e3:.1f} us ({byts / row[0] / 1e6:.0f} GB/s), "
              f"torch {row[1] * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
