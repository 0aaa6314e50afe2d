"""Times the encoder bias kernel (cuda_kernels/encoder_bias.cu) against its torch reference
at gen-ref's shape ([16, 8, 832, 832] bf16), CUDA-graph replays, after checking them equal."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr.kernels.encoder_bias import encoder_bias, encoder_bias_reference  # noqa: E402
from tools.graph_timing import graph_ms  # noqa: E402


def main() -> int:
    R, H, S = 16, 8, 832
    table = torch.randn(H, 2 * S - 1, device="cuda")
    keep = torch.arange(S, device="cuda")[None, :] < torch.randint(600, S + 1, (R, 1), device="cuda")
    same = torch.equal(encoder_bias(table, keep, torch.bfloat16).view(torch.int16),
                       encoder_bias_reference(table, keep, torch.bfloat16).view(torch.int16))
    k_ms = graph_ms(lambda: encoder_bias(table, keep, torch.bfloat16), reps=20)
    r_ms = graph_ms(lambda: encoder_bias_reference(table, keep, torch.bfloat16), reps=20)
    gb = R * H * S * S * 2 / 1e9
    print(f"encoder bias [{R}, {H}, {S}, {S}] bf16: kernel {k_ms * 1e3:.1f} us "
          f"({gb / k_ms * 1e3:.0f} GB/s), torch {r_ms * 1e3:.1f} us; bit-equal {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
