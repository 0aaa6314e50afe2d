"""Whether thread block clusters can carry the grid selection's cross-block step (issue 13): a
request's blocks as one cluster (8 at step 2 at beams of 1,024), exchanging their histograms
through distributed shared memory behind a cluster barrier, instead of global atomics, a fence,
a vote and one last block reading the lists back from L2 (``trie_topk_kept``). Measured on the
GPU, nothing of it is in the serving path yet.

- How many clusters of 8 (and of 2) blocks of 1,024 threads can be resident at once
  (``max_active_clusters``): the one-wave plan needs 16 of 8 for 16 requests on the H200's
  132 SMs, two to a GPC.
- Whether Numba's kernel launches with a cluster shape through ``cuda.core`` (its own launch
  path since numba-cuda 0.30) and whether a CUDA graph captures that launch.
- Correctness of the pieces: each block's rank in its cluster (``%cluster_ctarank``), the
  cluster barrier (``barrier.cluster.arrive.release`` / ``wait.acquire``), and loads from
  another block's shared memory (``mapa`` of a generic shared address, then a generic load):
  every block sums its cluster's 4,096-bin histograms, which the host checks.
- In-graph time of that exchange against the same kernel without it (each block its own
  histogram only), and against a kernel doing the global last-block pattern (atomics into a
  request histogram, a fence, a vote, the last block reading the histogram back).

    python3 tools/probe_cluster.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from llvmlite import ir
from numba import cuda, int32, int64, types, uint32
from numba.core import cgutils
from numba.cuda.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from graph_timing import graph_ms  # noqa: E402
from streamgr.kernels.numba_common import (as_array, cluster_sync,  # noqa: E402
                                            launch_clustered, ptx_statement, torch_stream)

NT = 1024
GB = 4096  # bins, as trie_topk_beams.GB
JIT = {"max_registers": 64}


@intrinsic
def cluster_rank(typingctx):
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        return builder.call(ir.InlineAsm(fnty, "mov.u32 $0, %cluster_ctarank;", "=r",
                                         side_effect=True), [])
    return types.uint32(), codegen


# the cluster barrier as the selection uses it (release/acquire), and without its ordering
# (its arrive compiles to no MEMBAR.GPU): timed only, to price the ordering
cluster_sync_relaxed = ptx_statement("barrier.cluster.arrive.relaxed.aligned;\n\t"
                                     "barrier.cluster.wait.aligned;")


@intrinsic
def remote_i32(typingctx, arr, idx, rank):
    """``arr[idx]`` (an int32 shared array) in the shared memory of block ``rank`` of this
    block's cluster: ``mapa`` maps the element's generic address to that block's."""
    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, value=args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        addr = builder.ptrtoint(ptr, ir.IntType(64))
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(64), ir.IntType(32)])
        asm = ir.InlineAsm(fnty, "{\n\t.reg .u64 t;\n\tmapa.u64 t, $1, $2;\n\t"
                           "ld.u32 $0, [t];\n\t}", "=r,l,r,~{memory}", side_effect=True)
        return builder.call(asm, [addr, builder.trunc(args[2], ir.IntType(32))
                                  if args[2].type.width > 32 else args[2]])
    return types.int32(arr, idx, rank), codegen


@cuda.jit(device=True)
def fill(hist, seed):
    """A block's histogram: a pattern of its seed, so the host can sum it."""
    for i in range(cuda.threadIdx.x, GB, NT):
        hist[i] = int32((seed * 7 + i * 3) & 15)


@cuda.jit(device=True)
def remote_sums(out, hist, blk, csize):
    """Each of this block's bins summed over its cluster's blocks' histograms."""
    t = cuda.threadIdx.x
    for e in range(GB // NT):
        g = t * (GB // NT) + e
        s = int32(0)
        for b in range(csize):
            s += remote_i32(hist, g, uint32(b))
        out[blk, g] = s


@cuda.jit(**JIT)
def clustered(out, ids, csize):
    hist = cuda.shared.array(GB, int32)
    rank = cluster_rank()
    blk = cuda.blockIdx.x
    fill(hist, blk)
    if cuda.threadIdx.x == 0:
        ids[blk, 0] = rank
        ids[blk, 1] = cuda.gridDim.x
    cluster_sync()
    remote_sums(out, hist, blk, csize)
    cluster_sync()  # no block leaves while another may still read its shared memory


@cuda.jit(**JIT)
def clustered_relaxed(out, ids, csize):
    hist = cuda.shared.array(GB, int32)
    blk = cuda.blockIdx.x
    fill(hist, blk)
    cluster_sync_relaxed()
    remote_sums(out, hist, blk, csize)
    cluster_sync_relaxed()


@cuda.jit(**JIT)
def alone(out, ids, csize):
    hist = cuda.shared.array(GB, int32)
    blk = cuda.blockIdx.x
    fill(hist, blk)
    cuda.syncthreads()
    t = cuda.threadIdx.x
    for e in range(GB // NT):
        g = t * (GB // NT) + e
        out[blk, g] = hist[g] * csize


@cuda.jit(**JIT)
def last_block(out, ws, csize):
    """The global pattern: atomics into the request's histogram, a fence, a vote, the last
    block of each group of ``csize`` reading the histogram back (and zeroing it)."""
    hist = cuda.shared.array(GB, int32)
    flag = cuda.shared.array(1, int32)
    blk = cuda.blockIdx.x
    r = blk // csize
    fill(hist, blk)
    cuda.syncthreads()
    for i in range(cuda.threadIdx.x, GB, NT):
        cuda.atomic.add(ws, (r, 1 + i), int64(hist[i]))
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        flag[0] = cuda.atomic.add(ws, (r, 0), int64(1)) == csize - 1
    cuda.syncthreads()
    if not flag[0]:
        return
    cuda.threadfence()
    for i in range(cuda.threadIdx.x, GB, NT):
        out[blk, i] = int32(ws[r, 1 + i])
        ws[r, 1 + i] = 0
    if cuda.threadIdx.x == 0:
        ws[r, 0] = 0


def cluster_launch(fn, args, blocks, csize, stream):
    """``fn`` on ``blocks`` blocks in clusters of ``csize``, as the selection launches
    (``numba_common.launch_clustered``)."""
    launch_clustered(fn, (blocks,), (csize,), NT, stream, 0, *args)


def main() -> None:
    import cuda.core as cc
    dev = torch.device("cuda")
    print("cuda.core", cc.__version__, "| numba-cuda",
          __import__("numba_cuda").__version__, flush=True)
    for csize, blocks in ((8, 128), (2, 96)):
        out = torch.zeros(blocks, GB, dtype=torch.int32, device=dev)
        ids = torch.full((blocks, 2), -1, dtype=torch.int32, device=dev)
        ws = torch.zeros(blocks // csize, GB + 1, dtype=torch.int64, device=dev)
        oa, ia, wa = as_array(out), as_array(ids), as_array(ws)
        stream = torch_stream(dev)
        clustered[1, NT, stream](oa, ia, 1)  # compiles (a cluster of one on a plain launch)
        clustered_relaxed[1, NT, stream](oa, ia, 1)
        alone[1, NT, stream](oa, ia, csize)
        last_block[1, NT, stream](oa, wa, 1)
        torch.cuda.synchronize()
        sig = next(iter(clustered.overloads))
        try:
            from cuda.core import LaunchConfig
            cfn = clustered.overloads[sig]._codelibrary.get_cufunc().kernel
            cfg = LaunchConfig(grid=blocks // csize, cluster=csize, block=NT)
            print(f"cluster {csize}: max active clusters",
                  cfn.occupancy.max_active_clusters(cfg), flush=True)
        except Exception as err:
            print(f"cluster {csize}: occupancy query failed: {err!r}", flush=True)
        out.zero_()
        ids.fill_(-1)
        try:
            cluster_launch(clustered, (oa, ia, csize), blocks, csize, stream)
            torch.cuda.synchronize()
        except Exception as err:  # this numba-cuda or cuda.core launches no clusters
            print(f"cluster {csize}: the cluster launch failed: {err!r}", flush=True)
            continue
        seeds = torch.arange(blocks, device=dev)
        bins = torch.arange(GB, device=dev)
        pat = ((seeds[:, None] * 7 + bins[None, :] * 3) & 15).to(torch.int32)
        want = pat.view(blocks // csize, csize, GB).sum(1).repeat_interleave(csize, 0)
        ranks_ok = torch.equal(ids[:, 0].cpu(), torch.arange(blocks) % csize)
        print(f"cluster {csize}: sums equal {torch.equal(out, want.to(torch.int32))}, ranks "
              f"{ranks_ok}, gridDim.x seen {int(ids[0, 1])}", flush=True)
        rows = [("clustered: DSMEM sums, 2 cluster barriers",
                 lambda: cluster_launch(clustered, (oa, ia, csize), blocks, csize,
                                        torch_stream(dev))),
                ("clustered, the barriers relaxed (timing only)",
                 lambda: cluster_launch(clustered_relaxed, (oa, ia, csize), blocks,
                                        csize, torch_stream(dev))),
                ("alone: own histogram only", lambda: alone[blocks, NT, torch_stream(dev)](
                    oa, ia, csize)),
                ("last block: atomics, fence, vote, read back",
                 lambda: last_block[blocks, NT, torch_stream(dev)](oa, wa, csize))]
        for name, fn in rows:
            try:
                print(f"cluster {csize} x {blocks} blocks, {name:>44}: "
                      f"{1000 * graph_ms(fn):8.2f} us", flush=True)
            except Exception as err:
                print(f"cluster {csize}, {name}: failed: {err!r}", flush=True)


if __name__ == "__main__":
    main()
