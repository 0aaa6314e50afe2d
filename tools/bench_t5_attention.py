"""T5 attention backends on gen-ref's shapes: which SDPA kernel the generate path should ask for.

The encoder's self-attention ([rows, heads, S, S] with the relative-position bias and the
padding mask as one additive bf16 bias) and the decoder's cross-attention (each request's beams
against its encoder states, the padding mask as bias) run through
``F.scaled_dot_product_attention``; this times each backend that accepts the inputs, inside a
CUDA graph (as the decode plans replay them), and checks each against the memory-efficient
kernel's output (max abs difference). Flash (no bias accepted) is timed without the bias, as a
bound. Then the encoder's own kernel (``kernels/t5_attention``: the bias from a [heads, 2S - 1]
table inside the kernel, no dense bias), against cuDNN plus the dense bias's construction
(``kernels/encoder_bias``), with the largest difference from cuDNN's output on real rows.

  python tools/bench_t5_attention.py                  # gen-ref: 16 rows, 8 heads, 832 keys, 256 beams
  python tools/bench_t5_attention.py --rows 32 --length 784 --beams 1   # a search's first step

The decoder's cross-attention also runs on the encoder kernel without the bias (``own_cross``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.graph_timing import graph_ms  # noqa: E402

BACKENDS = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION}


def heads(x: torch.Tensor, h: int) -> torch.Tensor:  # [R, T, H*d] -> [R, H, T, d], as t5.py
    return x.view(*x.shape[:-1], h, -1).transpose(-3, -2)


def case(name, q, k, v, bias, flops, reps):
    ref = None
    for bname, be in BACKENDS.items():
        b = None if bname == "flash" else bias
        try:
            with sdpa_kernel([be]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=b, scale=1.0)
                ms = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=b,
                                                                     scale=1.0), reps)
        except RuntimeError as e:
            print(f"{name:<34}{bname:<11}refused: {str(e).splitlines()[0][:80]}")
            continue
        if ref is None:
            ref = out
        err = float((out.float() - ref.float()).abs().max()) if b is not None else float("nan")
        print(f"{name:<34}{bname:<11}{ms:>9.4f} ms{flops / ms / 1e9:>9.1f} TFLOP/s  "
              f"max |diff| vs efficient {err:.3g}")


def own_kernel(x, mask, R, S, H, d, flops, reps) -> None:
    from streamgr.kernels import t5_attention as ta
    from streamgr.kernels.encoder_bias import encoder_bias
    table = torch.randn(H, 2 * S - 1, device=mask.device)
    q, k, v = (t.view(R, S, H, d) for t in x)
    kernels = ("mma", "wgmma") if d == 64 and torch.cuda.get_device_capability() == (9, 0) \
        else ("mma",)
    outs, times = {}, {}
    for kern in kernels:
        ta.KERNEL = kern
        outs[kern] = ta.encoder_attention(q, k, v, table, mask)
        times[kern] = graph_ms(lambda: ta.encoder_attention(q, k, v, table, mask), reps)
    ta.KERNEL = "auto"

    def dense():
        bias = encoder_bias(table, mask, q.dtype)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                  attn_mask=bias, scale=1.0)
    ref = dense().transpose(1, 2)
    ms_dense = graph_ms(dense, reps)
    real = mask[:, :, None, None].expand_as(ref)
    for kern, ms in times.items():
        err = float((outs[kern].float() - ref.float()).abs()[real].max())
        print(f"{'encoder, bias in the kernel':<34}{'t5 ' + kern:<11}{ms:>9.4f} ms"
              f"{flops / ms / 1e9:>9.1f} TFLOP/s  max |diff| vs cudnn (real rows) {err:.3g}")
    print(f"{'encoder, dense bias built + cudnn':<34}{'cudnn':<11}{ms_dense:>9.4f} ms"
          f"{flops / ms_dense / 1e9:>9.1f} TFLOP/s")


def own_cross(qc, x, mask, pad, R, S, H, d, B, reps) -> None:
    """The decoder's cross-attention on the wgmma T5 kernel without the bias, against cuDNN
    with the padding bias (what ``models/t5`` ran before)."""
    from streamgr.kernels import t5_attention as ta
    q = qc.transpose(1, 2)  # [R, beams, H, d] (a strided view, as the decoder's q)
    k, v = (t.view(R, S, H, d) for t in x[1:])
    if not ta.cross_kernel_applies(q, k):
        print(f"{'cross, own kernel':<34}{'t5 wgmma':<11}not on this GPU")
        return
    out = ta.cross_attention(q, k, v, mask)
    ms = graph_ms(lambda: ta.cross_attention(q, k, v, mask), reps)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(qc, *(t.transpose(1, 2) for t in (k, v)),
                                             attn_mask=pad, scale=1.0).transpose(1, 2)
    err = float((out.float() - ref.float()).abs().max())
    flops = 4 * R * H * B * S * d
    print(f"{'cross, own kernel (no mask tensor)':<34}{'t5 wgmma':<11}{ms:>9.4f} ms"
          f"{flops / ms / 1e9:>9.1f} TFLOP/s  max |diff| vs cudnn {err:.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--length", type=int, default=832, help="encoder length (bucketed)")
    ap.add_argument("--real", type=int, default=769, help="real tokens per row (rest padding)")
    ap.add_argument("--beams", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    R, H, S, d, B = a.rows, a.heads, a.length, a.d, a.beams
    mask = torch.zeros(R, S, dtype=torch.bool, device=dev)
    mask[:, :a.real] = True
    pad = torch.where(mask, 0.0, torch.finfo(bf).min).to(bf)[:, None, None, :]
    x = [torch.randn(R, S, H * d, device=dev, dtype=bf) for _ in range(3)]
    q, k, v = (heads(t, H) for t in x)
    pos_bias = torch.randn(1, H, S, S, device=dev, dtype=bf)
    full = (pos_bias + pad).contiguous()  # [R, H, S, S], as t5.py's encode builds it
    print(f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    enc_flops = 4 * R * H * S * S * d
    case("encoder, dense [R,H,S,S] bias", q, k, v, full, enc_flops, a.reps)
    case("encoder, [1,H,S,S] expanded bias", q, k, v, pos_bias.expand(R, H, S, S), enc_flops,
         a.reps)
    own_kernel(x, mask, R, S, H, d, enc_flops, a.reps)
    qc = torch.randn(R, B, H, d, device=dev, dtype=bf).transpose(1, 2)  # [R, H, beams, d]
    case("cross, [R,1,1,S] padding bias", qc, k, v, pad, 4 * R * H * B * S * d, a.reps)
    case("cross, padding bias expanded", qc, k, v, pad.expand(R, H, B, S),
         4 * R * H * B * S * d, a.reps)
    own_cross(qc, x, mask, pad, R, S, H, d, B, a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
