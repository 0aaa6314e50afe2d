"""The CUDA side of the jagged HSTU attention: a plan per batch, a run per layer.

FlashInfer's split of planning from running: :func:`plan` turns a batch's layout
(:class:`~streamgr.kernels.hstu_attention.JaggedKV`, whose pages are the cache manager's CSR
page table) into the work items of ``cuda_kernels/hstu_attention.cu`` once per batch, on the
host, copied to the device in one transfer; :func:`run` launches them for one layer. The torch
reference in ``hstu_attention.py`` is the judge of both.

The plan cuts each user's query rows into tiles of 128 and their visible keys into chunks of
512 absolute positions. When the row tiles alone fill the GPU with balanced work (recompute of
long histories) each tile runs over all its keys, folding its chunks into one fp32 slot
(*direct*); when they do not (a cached batch: a few hundred query rows against thousands of
history keys) each (tile, chunk) is its own CUDA block with its own slot (*split*). A merge
kernel then adds each tile's slots in order and writes bf16. Both add the same chunk partials
in the same order, so the plan never changes a result's bits.

By default (*tiles with tails*; ``STREAMGR_HSTU_TAIL=0`` turns it off) a user's last <= 16
rows past a full tile join that tile, computed on its K/V tiles by all four warps, instead of a thin tile of their
own: the same MMAs in the same order, so again no change in a result's bits.

Two forward kernels run a plan, with the same bits: the mma.sync one (``hstu_attention.cu``)
and a warp-specialized wgmma one for Hopper (``hstu_attention_wgmma.cu``). By default
(``STREAMGR_HSTU_KERNEL=auto``) direct plans without tails run on wgmma (faster over a
recompute's long row tiles) and the rest on mma.sync (faster on a cached batch's short chunk
items); docs/benchmarks.md has both.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import StreamgrError
from . import _cuda
from .pinned import PinnedPool
from .hstu_plan import (BM, BN, KC, SR, STAGES, SUB, TAIL, TAILS, Capacity, _env_ints,
                        page_csr, plan_host, plan_host_pair)


log = logging.getLogger("streamgr.kernels")

DEFINES = (f"HSTU_BN={BN}", f"HSTU_STAGES={STAGES}", f"HSTU_SUB={SUB}", f"HSTU_KC={KC}")
SRC = "hstu_attention.cu"
EXPRS = tuple(e for d in (32, 64, 128) for e in (
    *(f"hstu_attn_fwd<{d}, {a}, {t}>" for a in ("true", "false") for t in ("false", "true")),
    f"hstu_attn_merge<{d}>"))
# The wgmma forward (sm_90a): the same items and slots, finished by the same merge.
WG_SRC = "hstu_attention_wgmma.cu"
WG_EXPRS = tuple(f"hstu_attn_fwd_wg<{d}, {f}>" for d in (32, 64, 128) for f in ("true", "false"))


def _wg_config() -> tuple[int, int, int, int, int]:
    """K/V stages, the S / P V overlap (always on), Q in registers, the consumers' ping-pong
    and the keys per tile of the wgmma kernel (HSTU_WG_STAGES, HSTU_WG_OVERLAP, HSTU_WG_QREG,
    HSTU_WG_PINGPONG, HSTU_WG_BN); ``STREAMGR_HSTU_WG=4x1x0x1x64`` picks another for A/B
    benchmarks. The default, 3 stages of 128-key tiles with Q in shared memory, was the
    fastest on the H200 (docs/benchmarks.md, session 9); Q in registers spills the D = 128
    direct build (consumers get 224 registers); 128-key tiles fit 3 stages at most."""
    stages, overlap, qreg, pingpong, keys = _env_ints(
        "STREAMGR_HSTU_WG", "3x1x0x1x128", "STAGESxOVERLAPxQREGxPINGPONGxKEYS")
    if stages not in (3, 4) or overlap != 1 or qreg not in (0, 1) or pingpong not in (0, 1) \
            or keys not in (64, 128) or (keys == 128 and stages > 3):
        raise StreamgrError("STREAMGR_HSTU_WG: stages 3 or 4 (3 with 128 keys), overlap 1, "
                            "flags 0 or 1, keys 64 or 128")
    return stages, overlap, qreg, pingpong, keys


WG_STAGES, WG_OVERLAP, WG_QREG, WG_PINGPONG, WG_BN = _wg_config()
WG_DEFINES = (f"HSTU_WG_STAGES={WG_STAGES}", f"HSTU_WG_OVERLAP={WG_OVERLAP}",
              f"HSTU_WG_QREG={WG_QREG}", f"HSTU_WG_PINGPONG={WG_PINGPONG}",
              f"HSTU_WG_BN={WG_BN}", f"HSTU_KC={KC}")


@functools.lru_cache(maxsize=8)
def _kernel_choice(index: int) -> str:
    """``STREAMGR_HSTU_KERNEL``: ``auto`` (the default): direct plans without tails (a
    recompute's long row tiles) on the wgmma kernel, the rest (a cached batch's short
    chunk items and tiles with tails) on the mma.sync one, each where it is faster on the H200;
    ``mma`` or ``wgmma``: every plan on that kernel. The two give the same bits (the same
    k16 MMA steps in the same order, the same SiLU and folds; tested on random batches), so
    the choice never changes a result and a cached batch still equals its recompute. wgmma
    needs Hopper (compute capability 9.0) and 64-key tiles; ``auto`` is ``mma`` elsewhere."""
    choice = os.environ.get("STREAMGR_HSTU_KERNEL", "auto").lower()
    if choice not in ("auto", "wgmma", "mma"):
        raise StreamgrError(f"STREAMGR_HSTU_KERNEL={choice!r}: auto, wgmma or mma")
    if choice == "mma":
        return choice
    if BN != 64 or torch.cuda.get_device_capability(index) != (9, 0):
        if choice == "wgmma":
            raise StreamgrError("STREAMGR_HSTU_KERNEL=wgmma needs an sm_90 GPU and 64-key tiles")
        return "mma"
    try:
        _cuda.arch_module(WG_SRC, WG_EXPRS, "sm_90a", WG_DEFINES)  # compiles, or raises why not
    except Exception as err:  # noqa: BLE001 - e.g. a CuPy without the NVRTC hook for sm_90a
        if choice == "wgmma":
            raise
        log.warning("the wgmma attention kernel did not build (%s): mma.sync for every plan",
                    err)
        return "mma"
    return choice


def _use_wgmma(index: int) -> bool:
    """Every plan on the wgmma kernel (``STREAMGR_HSTU_KERNEL=wgmma``)."""
    return _kernel_choice(index) == "wgmma"


def _wgmma_runs(p: "Plan", index: int, dim: int) -> bool:
    """Whether plan ``p`` runs on the wgmma kernel (see ``_kernel_choice``)."""
    choice = _kernel_choice(index)
    return choice == "wgmma" or (choice == "auto" and not p.split and p.max_rows == BM
                                 and dim % 64 == 0)


def _retile(hp, tails: bool, device: torch.device, dim: int) -> bool:
    """Whether ``hp``, a plan tiled with tails, should be tiled again without them: a direct
    plan (a recompute's) that ``auto`` then runs on the wgmma kernel, which has no tails (its
    few tail rows take thin tiles)."""
    return (tails and not hp.split and hp.max_rows > BM and device.type == "cuda"
            and dim % 64 == 0 and _kernel_choice(device.index or 0) == "auto")


@dataclass
class Plan:
    split: bool
    n_items: int
    n_fin: int        # row tiles to merge
    n_slots: int      # fp32 partials of [BM, D] per head
    args: list        # device int32 views, in the kernel's order
    fin_args: list
    workspace: dict   # (H, D, device) -> fp32 workspace, reused by every layer of the batch
    max_rows: int = BM  # a tile's rows at most (SR: tiles may carry tails)


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def warm(device: torch.device) -> None:
    """Compile the attention kernels now, not in a first batch: the mma.sync module (CuPy
    caches it on disk) and, where ``auto`` or ``wgmma`` runs it, the wgmma one (NVRTC, a few
    seconds per process). Nothing where CuPy is unavailable (the torch reference runs)."""
    if device.type != "cuda" or _cuda._cupy() is None:
        return
    try:
        _cuda.module(SRC, EXPRS, DEFINES)
        _kernel_choice(device.index or 0)
    except Exception as err:  # noqa: BLE001 - the first batch raises it again, where it is used
        log.warning("attention kernels not compiled ahead (%s)", err)


def tails_for(device: torch.device, dim: int) -> bool:
    """Whether plans for this device and head dim use tails: asked for, and the kernel that
    runs them has the path (the mma.sync one with 64-key tiles, head dims 64 and 128)."""
    return (TAILS and BN == 64 and dim >= 64
            and not (device.type == "cuda" and _use_wgmma(device.index or 0)))


def plan_pair(desc, device: torch.device, heads: int, dim: int, sms: int) -> tuple:
    """:func:`plan_host_pair` (every layer's plan and the last layer's), a direct one without
    tails where the wgmma kernel takes it (``_retile``)."""
    tails = tails_for(device, dim)
    hps = plan_host_pair(desc, heads, sms, tails=tails)
    if _retile(hps[0], tails, device, dim):
        hps = plan_host_pair(desc, heads, sms, tails=False)
    return hps


_PLAN_STAGING = PinnedPool(torch.int32, 1 << 14)  # plans' work items on their way up


def plan(desc, device: torch.device, heads: int, force: str | None = None,
         dim: int = 0, cand_only: bool = False) -> Plan:
    """:func:`plan_host`, copied to the device in one transfer."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
    tails = tails_for(device, dim)
    hp = plan_host(desc, heads, sms, force, tails, cand_only)
    if _retile(hp, tails, device, dim):
        hp = plan_host(desc, heads, sms, "direct", False, cand_only)
    arrays = list(hp.items) + list(hp.users) + [hp.page_ptr, hp.pages] + list(hp.fin)
    sizes = [len(a) for a in arrays]
    flat = np.concatenate(arrays).astype(np.int32)
    # from a pooled page-locked buffer on CUDA (kernels/pinned.py: why)
    dev = _PLAN_STAGING.upload(flat, device) if device.type == "cuda" else torch.from_numpy(flat)
    views = list(torch.split(dev, sizes))
    return Plan(hp.split, len(hp.items[0]), len(hp.fin[0]), hp.n_slots, views[:13], views[13:],
                {}, hp.max_rows)


def static_plan(split: bool, cap: Capacity, dev: torch.Tensor, max_rows: int = BM) -> Plan:
    """A plan over a static device buffer laid out by ``cap`` (filled by :func:`pad_plan`)."""
    views = list(torch.split(dev, cap.sizes))
    return Plan(split, cap.items, cap.fin, cap.slots, views[:13], views[13:], {}, max_rows)


def row_stride(t: torch.Tensor, H: int, D: int) -> int | None:
    """Row stride (elements) if the kernel can read ``t`` in place: heads of ``D`` contiguous
    elements, 16-byte aligned rows."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != D or t.shape[1] != H:
        return None
    if t.stride(0) % 8 or t.data_ptr() % 16:
        return None
    return t.stride(0)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, desc, layer: int, alpha: float,
        max_len: int, out: torch.Tensor, p: Plan) -> None:
    """One layer: bf16 ``q, k, v`` ``[rows, H, D]`` (strided views allowed), ``out`` contiguous."""
    H, D = q.shape[1], q.shape[2]
    if p.n_items == 0 and p.n_fin == 0:
        return
    strides = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        s = row_stride(t, H, D)
        if s is None:
            raise StreamgrError(f"hstu_attention: {name} must have heads of {D} contiguous "
                                f"elements and 16-byte aligned rows (stride {tuple(t.stride())})")
        strides.append(np.int64(s))
    store = desc.store[layer] if desc.store is not None else None
    key = (H, D, q.device)
    ws = p.workspace.get(key)
    if ws is None:  # one per plan: every layer of the batch reuses it
        ws = p.workspace[key] = torch.empty(max(1, p.n_slots) * H * SR * D,
                                            dtype=torch.float32, device=q.device)
    flag = 'false' if p.split else 'true'  # the kernels' DIRECT
    tails = p.max_rows > BM
    slot_rows = SR if tails else BM  # the forward kernels' slot stride (rows)
    extra = ()
    merge_needed = True
    if _wgmma_runs(p, q.device.index or 0, D):
        if tails:
            raise StreamgrError("hstu_attention: the wgmma kernel has no tiles with tails")
        fn = _cuda.arch_kernel(WG_SRC, WG_EXPRS, f"hstu_attn_fwd_wg<{D}, {flag}>", "sm_90a",
                               WG_DEFINES)
        extra = (_cuda.ptr(out),)
        merge_needed = p.split  # a direct plan's blocks write their rows themselves
        # a producer warpgroup and two consumers; Q, the K/V stages, then 2 STAGES + 1 mbarriers
        # (+ 1 KB: the kernel aligns its swizzled tiles to 1,024 bytes)
        threads, smem = 384, (BM + 2 * WG_STAGES * WG_BN) * D * 2 + 8 * (2 * WG_STAGES + 1) + 1024
    else:
        fn = _cuda.kernel(SRC, EXPRS, f"hstu_attn_fwd<{D}, {flag}, {'true' if tails else 'false'}>",
                          DEFINES)
        threads = 128
        smem = (slot_rows + 2 * STAGES * BN) * (D + 8) * 2 + (TAIL * (BN + 8) * 2 if tails else 0)
        extra = (np.int32(p.max_rows),)
    scal = (*strides, np.float32(alpha), np.float32(1.0 / max_len))
    if p.n_items:
        # split plans with the head fastest (the longest chunks first across all heads), direct
        # ones item-major: each the faster on the H200 (block_item_head, hstu_common.cuh)
        grid = (p.n_items * H,) if p.split else (p.n_items, H)
        _cuda.launch(fn, grid, (threads,), (
            _cuda.ptr(q), _cuda.ptr(k), _cuda.ptr(v), _cuda.ptr(store), _cuda.ptr(ws),
            *(_cuda.ptr(t) for t in p.args), np.int32(H), np.int32(desc.page_tokens), *scal,
            *extra), shared_mem=smem)
    if p.n_fin and merge_needed:
        a = p.args
        merge = _cuda.kernel(SRC, EXPRS, f"hstu_attn_merge<{D}>", DEFINES)
        _cuda.launch(merge, (p.n_fin * (slot_rows // 4), H), (128,), (
            _cuda.ptr(q), _cuda.ptr(k), _cuda.ptr(v), _cuda.ptr(out), _cuda.ptr(ws),
            *(_cuda.ptr(t) for t in p.fin_args), _cuda.ptr(a[5]), _cuda.ptr(a[7]),
            _cuda.ptr(a[8]), np.int32(H), *scal, np.int32(p.max_rows), np.int32(slot_rows)))


# -- the previous kernel (WMMA, one block per 64-row tile and head), kept for A/B benchmarks --

_WMMA_EXPRS = tuple(f"hstu_attention_fwd<{d}>" for d in (32, 64, 128))


def run_wmma(q, k, v, desc, layer: int, alpha: float, max_len: int, out: torch.Tensor) -> None:
    if "wmma" not in desc._cache:
        tu, tr = [], []
        for b in range(len(desc.num_candidates)):
            for r0 in range(0, desc.q_offsets[b + 1] - desc.q_offsets[b], 64):
                tu.append(b), tr.append(r0)
        page_ptr, flat = page_csr(desc)
        arrays = [tu, tr, desc.q_offsets, desc.hist_lens, desc.new_lens, desc.num_candidates,
                  [int(f) for f in desc.paged], desc.kv_rows, page_ptr, flat]
        host = np.concatenate([np.asarray(a, dtype=np.int32) for a in arrays])
        dev = torch.from_numpy(host).to(q.device)
        desc._cache["wmma"] = (len(tu), list(torch.split(dev, [len(a) for a in arrays])))
    n_tiles, a = desc._cache["wmma"]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    H, D = q.shape[1], q.shape[2]
    store = desc.store[layer] if desc.store is not None else None
    fn = _cuda.kernel("hstu_attention_wmma.cu", _WMMA_EXPRS, f"hstu_attention_fwd<{D}>")
    smem = (3 * 64 * D + 64 * 64) * 2 + 64 * 64 * 4
    _cuda.launch(fn, (n_tiles, H), (128,), (
        _cuda.ptr(q), _cuda.ptr(k), _cuda.ptr(v), _cuda.ptr(store), _cuda.ptr(out),
        *(_cuda.ptr(t) for t in a), np.int32(H), np.int32(desc.page_tokens),
        np.float32(alpha), np.float32(1.0 / max_len)), shared_mem=smem)
