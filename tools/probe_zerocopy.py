"""Can a batch's small uploads avoid queuing behind a host hit's onload on the copy engine?

Host-to-device copies of every stream share the copy engine in issue order (H200, session
21), so a host-hit batch queues its own uploads (rows, append slots, attention plans, ~1 MB)
before its onload's first copy, and the onload starts only after the batch's host prelude
(~4.3 ms from the batch's start, session 24). This probe times, on one GPU, a small upload of
``--small-kb`` while a large pinned copy of ``--big-mb`` is in flight on another stream:

- ``ce``: ``copy_`` (the copy engine), alone and issued just after the large copy;
- ``sm`` (``--sm``): a kernel reading the page-locked source in place over PCIe, unified
  addressing, no copy engine (``pinned.read_host``: the engine's ``STREAMGR_UPLOAD_BY_SM``
  uploads), alone and beside the large copy;
- the large copy's own time, alone and with the small upload beside it.

H200, session 24: two torch page-locked buffers' copies on two streams did not queue (a 1 MB
upload beside 512 MB in flight: 0.028-0.030 ms), while in the engine a host hit's uploads
waited behind all of its onload. ``--matrix`` varies what differs in the engine: the source
page-locked by registration, raw ``cudaMemcpyAsync`` calls, high-priority streams; session 25:
none of the eight queued (0.023-0.027 ms), so the engine's wait is not reproduced here; read
by the SMs (``smup``) the engine's uploads did not wait.

    python3 tools/probe_zerocopy.py --chunk-mb 2 --sm --matrix   # the H200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from streamgr.kernels.pinned import read_host  # noqa: E402


def _timed(stream: torch.cuda.Stream, fn) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """(start, end) events around ``fn()`` on ``stream``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    return start, end


def _source(nbytes: int, how: str) -> tuple[torch.Tensor, object]:
    """A page-locked host buffer: torch's allocator (``torch``) or, as the engine's host store
    is, an anonymous huge-page mapping page-locked in place (``registered``)."""
    if how == "torch":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
    from streamgr.cache.store import host_tensor
    t = host_tensor((nbytes,), torch.uint8, True)
    t.fill_(1)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    assert int(err) == 0, err
    return t, lambda: torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def measure(args, source: str, raw: bool, priority: int) -> dict[str, float]:
    """Medians (ms) of every timing below for one setting: the large copy's source
    (``source``), issued as torch copies or raw ``cudaMemcpyAsync`` calls (``raw``, as the
    onload's), on streams of ``priority`` (the engine's batch streams: -1)."""
    dev = torch.device("cuda")
    big_h, release = _source(args.big_mb << 20, source)
    big_d = torch.empty(big_h.numel(), dtype=torch.uint8, device=dev)
    small_h = torch.randint(0, 255, (args.small_kb << 10,), dtype=torch.uint8).pin_memory()
    small_d = torch.empty_like(small_h, device=dev)
    a, b = torch.cuda.Stream(priority=priority), torch.cuda.Stream(priority=priority)
    rows: dict[str, list[float]] = {}
    step = (args.chunk_mb << 20) or big_h.numel()
    if raw:
        import cupy as cp
        rt = cp.cuda.runtime

    def big_copy() -> None:
        for o in range(0, big_h.numel(), step):
            n = min(step, big_h.numel() - o)
            if raw:
                rt.memcpyAsync(big_d.data_ptr() + o, big_h.data_ptr() + o, n,
                               rt.memcpyHostToDevice, torch.cuda.current_stream().cuda_stream)
            else:
                big_d[o:o + n].copy_(big_h[o:o + n], non_blocking=True)

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

    ce = lambda: small_d.copy_(small_h, non_blocking=True)  # noqa: E731
    sm = lambda: read_host(small_d, small_h)  # noqa: E731  (the engine's smup uploads)
    for _ in range(args.repeats + 1):  # the first round warms up (kernel compile, allocations)
        run("alone", None, True)
        run("ce alone", ce, False)
        run("ce beside", ce, True)
        if args.sm:
            run("sm alone", sm, False)
            run("sm beside", sm, True)
    torch.cuda.synchronize()
    if release is not None:
        release()
    return {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in rows.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mb", type=int, default=512)
    ap.add_argument("--small-kb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-mb", type=int, default=0,
                    help="the large copy as copies of this many MB each (the onload's are 2)")
    ap.add_argument("--sm", action="store_true", help="also the kernel reading in place")
    ap.add_argument("--matrix", action="store_true",
                    help="every setting of source (torch / registered), copies (torch / raw) "
                         "and stream priority (0 / -1): which of them makes a small upload "
                         "wait behind the large copy (the engine's onload uses registered, "
                         "raw, -1)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 0
    settings = ([(s, r, p) for s in ("torch", "registered") for r in (False, True)
                 for p in (0, -1)] if args.matrix else [("torch", False, 0)])
    print(f"large copy {args.big_mb} MB in copies of {(args.chunk_mb or args.big_mb)} MB, small "
          f"upload {args.small_kb} KB on a second stream, median ms of {args.repeats}")
    for source, raw, prio in settings:
        got = measure(args, source, raw, prio)
        print(f"source {source:10s} copies {'raw' if raw else 'torch':5s} priority {prio:2d}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in got.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
