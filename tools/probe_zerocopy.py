"""Can a batch's small uploads avoid queuing behind a host hit's onload on the copy engine?

Host-to-device copies of every stream share the copy engine in issue order (H200, session
21), so a host-hit batch queues its own uploads (rows, append slots, attention plans, ~1 MB)
before its onload's first copy, and the onload starts only after the batch's host prelude
(~4.3 ms from the batch's start, session 24). This probe times, on one GPU, a small upload of
``--small-kb`` while a large pinned copy of ``--big-mb`` is in flight on another stream:

- ``ce``: ``copy_`` (the copy engine), alone and issued just after the large copy;
- ``sm``: a kernel reading the page-locked source in place over PCIe (unified addressing, no
  copy engine), alone and beside the large copy;
- the large copy's own time, alone and with the kernel's reads beside it.

If ``sm`` beside the large copy stays near its time alone, uploads could go that way and the
onload could start as soon as the split is known (not built: a finding for the next session).

    python3 tools/probe_zerocopy.py            # the H200
"""

from __future__ import annotations

import argparse
import sys

import torch


def _timed(stream: torch.cuda.Stream, fn) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """(start, end) events around ``fn()`` on ``stream``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    return start, end


def sm_copy(dst: torch.Tensor, src_pinned: torch.Tensor) -> None:
    """``dst[:] = src_pinned`` by a kernel reading host memory (the pinned tensor's pointer is
    valid on the device under unified addressing), on the current stream."""
    import cupy as cp
    n = src_pinned.numel() * src_pinned.element_size()
    mem = cp.cuda.UnownedMemory(src_pinned.data_ptr(), n, src_pinned, 0)
    src = cp.ndarray((n // 4,), cp.int32, cp.cuda.MemoryPointer(mem, 0))
    out = cp.asarray(dst.view(torch.int32))
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        cp.copyto(out, src)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mb", type=int, default=512)
    ap.add_argument("--small-kb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-mb", type=int, default=0,
                    help="the large copy as copies of this many MB each (the onload's are 2)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 0
    dev = torch.device("cuda")
    big_h = torch.empty(args.big_mb << 20, dtype=torch.uint8, pin_memory=True)
    big_d = torch.empty_like(big_h, device=dev)
    small_h = torch.randint(0, 255, (args.small_kb << 10,), dtype=torch.uint8).pin_memory()
    small_d = torch.empty_like(small_h, device=dev)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    rows: dict[str, list[float]] = {}

    def run(name: str, small, with_big: bool) -> None:
        torch.cuda.synchronize()
        small_d.zero_()
        torch.cuda.synchronize()
        big = _timed(a, big_copy) if with_big else None
        s = _timed(b, small) if small is not None else None
        torch.cuda.synchronize()
        if s is not None:
            assert torch.equal(small_d.cpu(), small_h), name
            rows.setdefault(f"{name}: small upload ms", []).append(s[0].elapsed_time(s[1]))
        if big is not None:
            rows.setdefault(f"{name}: large copy ms", []).append(big[0].elapsed_time(big[1]))

    step = (args.chunk_mb << 20) or big_h.numel()

    def big_copy() -> None:
        for o in range(0, big_h.numel(), step):
            big_d[o:o + step].copy_(big_h[o:o + step], non_blocking=True)

    ce = lambda: small_d.copy_(small_h, non_blocking=True)  # noqa: E731
    sm = lambda: sm_copy(small_d, small_h)  # noqa: E731
    for _ in range(args.repeats + 1):  # the first round warms up (kernel compile, allocations)
        run("alone", None, True)
        run("ce alone", ce, False)
        run("sm alone", sm, False)
        run("ce beside", ce, True)
        run("sm beside", sm, True)
    print(f"large copy {args.big_mb} MB in copies of {step >> 20} MB, small upload "
          f"{args.small_kb} KB, "
          f"median of {args.repeats} (first round dropped)")
    for k, v in rows.items():
        v = sorted(v[1:])
        print(f"  {k:32s} {v[len(v) // 2]:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
