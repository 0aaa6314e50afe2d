"""What the Numba CUDA kernels share. On the host: torch tensors as Numba arrays without copies
(``__cuda_array_interface__``, no stream sync, so a CUDA graph captures the launch) and torch's
current stream as a Numba stream. On the device, for kernels that read bf16 tensors as 32- or
64-bit words (torch's bf16 has no Numba type): bf16 <-> fp32 by bits (a 16-bit shift one way,
round to nearest even the other, as torch does) and sums across a row's lanes; for kernels
whose blocks hand work to one another, int64 atomics released or acquired at GPU scope
(``add_release``, ``add_acquire``: one ordered atomic each, lighter than a ``threadfence``
beside a relaxed one); loads from an address taken once (``row_at``, ``base_at``,
``load_at``: one multiply-add an element where LLVM re-forms a 2-D index's 64-bit arithmetic at
each). Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) kernels run as Python: arrays are
numpy's, bit casts go through numpy, and the sums through shared memory (it has no warp
shuffles)."""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from numba import cuda, int32, int64

from .decoder_attention import SIMULATED

# Device functions are inlined by LLVM (``forceinline``: NVVM's alwaysinline), not in Numba's IR
# (``inline="always"``, what ``inline=True`` means): the IR inliner deep-copies a callee's IR at
# every call site, and merge_select took 105 s to compile that way against 13 s this way (CPU,
# session 39). The simulator's ``cuda.jit`` takes no ``forceinline``.
INLINE = {} if SIMULATED else {"forceinline": True}


# STREAMGR_NUMBA_STAMP=<device address of an int64 buffer>: kernels that call ``stamp`` write
# thread 0's SM clock at their phase boundaries there (tools/probe_topk.py --timeline); unset
# (the default) ``stamp`` compiles to nothing.
STAMP = 0 if SIMULATED else int(os.environ.get("STREAMGR_NUMBA_STAMP", "0"), 0)
STAMP_SLOTS = 16  # per block: slot s of block (y, x) at (y * gridDim.x + x) * 16 + s
STAMP_SECOND = 4096  # a kernel's second launch stamps blocks from here (``stamp(s, 1)``)


def as_array(t: torch.Tensor):
    """``t`` as the kernels' argument: a Numba device array view (numpy under the simulator)."""
    return t.numpy() if SIMULATED else cuda.as_cuda_array(t, sync=False)


@functools.lru_cache(maxsize=64)
def _external(handle: int):
    return cuda.external_stream(handle)


def torch_stream(device):
    """torch's current stream on ``device`` as a Numba stream (cached per handle)."""
    return _external(torch.cuda.current_stream(device).cuda_stream)

if SIMULATED:
    def as_float(bits):
        return np.array([int(bits) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def as_bits(x):
        return int(np.array([x], dtype=np.float32).view(np.uint32)[0])

    def rsqrt(x):
        return np.float32(1.0) / np.sqrt(np.float32(x))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, **INLINE)
    def as_float(bits):
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, **INLINE)
    def as_bits(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF

    @cuda.jit(device=True, **INLINE)
    def rsqrt(x):
        return libdevice.rsqrtf(x)


@cuda.jit(device=True, **INLINE)
def bf16(x):  # fp32 -> bf16 bits, round to nearest even (finite inputs)
    u = as_bits(x)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


@cuda.jit(device=True, **INLINE)
def pack(a, b):
    """Two fp32 as the int32 of their bf16 pair (``a`` the low half)."""
    v = (bf16(b) << 16) | bf16(a)
    return int32(v - (1 << 32) if v >= (1 << 31) else v)


@cuda.jit(device=True, **INLINE)
def quad_bf(quad, k):  # the k-th bf16 of a 64-bit quad (little-endian), as fp32
    if k == 0:
        return as_float((int64(quad) & 0xFFFF) << 16)
    return as_float((int64(quad) >> (16 * k - 16)) & 0xFFFF0000)


def lane_sum(width: int):
    """A device function ``(x, red, r, lane)``: the sum of ``x`` over the ``width`` (16 or
    32) lanes of row slot ``r``, in every one of them. Shuffles within the row's lanes on the
    GPU; through ``red[r, :width]`` (shared, fp32) with block barriers in the simulator, so
    every thread of the block must call it (no early return before)."""
    if SIMULATED:
        @cuda.jit(device=True)
        def total(x, red, r, lane):
            red[r, lane] = x
            cuda.syncthreads()
            w = width // 2
            while w > 0:
                if lane < w:
                    red[r, lane] += red[r, lane + w]
                cuda.syncthreads()
                w //= 2
            out = red[r, 0]
            cuda.syncthreads()  # all have read it before the next call overwrites it
            return out
        return total

    @cuda.jit(device=True, **INLINE)
    def total(x, red, r, lane):  # a butterfly: every lane of the row gets the sum
        w = width // 2
        while w > 0:
            x += cuda.shfl_xor_sync(0xFFFFFFFF, x, w)
            w //= 2
        return x
    return total


if SIMULATED:
    @cuda.jit(device=True, **INLINE)
    def add_release(ary, i, j, val):
        """``ary[i, j] += val`` (int64), released: its old value."""
        cuda.threadfence()
        return cuda.atomic.add(ary, (i, j), val)

    @cuda.jit(device=True, **INLINE)
    def add_acquire(ary, i, j, val):
        """``ary[i, j] += val`` (int64), acquired: its old value."""
        old = cuda.atomic.add(ary, (i, j), val)
        cuda.threadfence()
        return old
else:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.core import cgutils as _cgutils
    from numba.cuda.extending import intrinsic as _intrinsic

    def _item_address(context, builder, sig, args):
        """An intrinsic's ``args[0][args[1], args[2]]`` address as an int64 (no wraparound)."""
        aryty = sig.args[0]
        a = context.make_array(aryty)(context, builder, value=args[0])
        at = [context.cast(builder, args[n], sig.args[n], _types.intp) for n in (1, 2)]
        ptr = _cgutils.get_item_pointer(context, builder, aryty, a, at, wraparound=False)
        return builder.ptrtoint(ptr, _ir.IntType(64))

    def _add_ordered(order, doc):
        """An intrinsic ``ary[i, j] += val`` (int64) as one ``atom.{order}.gpu`` (returns the
        old value)."""
        @_intrinsic
        def add(typingctx, ary, i, j, val):
            def codegen(context, builder, sig, args):
                fnty = _ir.FunctionType(_ir.IntType(64), [_ir.IntType(64), _ir.IntType(64)])
                asm = _ir.InlineAsm(fnty, f"atom.{order}.gpu.global.add.u64 $0, [$1], $2;",
                                    "=l,l,l", side_effect=True)
                return builder.call(asm, [_item_address(context, builder, sig, args),
                                          context.cast(builder, args[3], sig.args[3],
                                                       _types.int64)])
            return _types.int64(ary, i, j, val), codegen
        add.__doc__ = doc
        return add

    add_release = _add_ordered("release", """``ary[i, j] += val`` (int64) as one release atomic
        at GPU scope: the thread's (and, after a barrier, its block's) writes before it are
        visible to whoever sees the add. It compiles to ``MEMBAR.ALL.GPU`` and the atomic, where
        ``threadfence`` (``fence.sc``) adds ``CCTL.IVALL``, dropping the SM's L1 (spilled
        registers included). Returns the old value.""")
    add_acquire = _add_ordered("acquire", """``ary[i, j] += val`` (int64) as one acquire atomic
        at GPU scope: what was released before the value it reads is visible to the thread's
        (and, after a barrier, its block's) loads after it. It compiles to the atomic and
        ``CCTL.IVALL``, where ``threadfence`` adds ``MEMBAR.SC.GPU`` (which waits for the
        thread's own stores). Returns the old value.""")


if SIMULATED:
    def row_at(ary, i, j):
        """``ary[i, j:]``'s start, for ``load_at`` (here a numpy view)."""
        return ary[i, j:]

    def base_at(ary):
        """``ary``'s start, for ``load_at`` (here the array)."""
        return ary

    def load_at(ary, at, n):
        """The element ``n`` past ``row_at``'s ``at`` (``ary`` gives the type)."""
        return at[n]
else:
    @_intrinsic
    def row_at(typingctx, ary, i, j):
        """``ary[i, j]``'s address (int64), through an empty ``mov`` LLVM cannot see into: left
        to LLVM, ``ary[i, j + n]`` for several ``n`` re-forms ``(i * cols + j + n) * size +
        base`` at each, four SASS instructions an element against ``load_at``'s one."""
        def codegen(context, builder, sig, args):
            fnty = _ir.FunctionType(_ir.IntType(64), [_ir.IntType(64)])
            asm = _ir.InlineAsm(fnty, "mov.b64 $0, $1;", "=l,l")
            return builder.call(asm, [_item_address(context, builder, sig, args)])
        return _types.int64(ary, i, j), codegen

    @_intrinsic
    def base_at(typingctx, ary):
        """``ary``'s first element's address (int64), for ``load_at``."""
        def codegen(context, builder, sig, args):
            a = context.make_array(sig.args[0])(context, builder, value=args[0])
            return builder.ptrtoint(a.data, _ir.IntType(64))
        return _types.int64(ary), codegen

    @_intrinsic
    def load_at(typingctx, ary, at, n):
        """The element ``n`` (unsigned 32-bit: zero-extended) past ``row_at``'s address
        ``at``, read as ``ary``'s dtype from global memory (``ld.global``). ``n`` passes an
        empty ``mov`` too: LLVM otherwise widens a 32-bit ``f + i`` to a 64-bit add and mask,
        and the address takes two ``LEA``s where ``mul.wide.u32`` takes one ``IMAD.WIDE``."""
        def codegen(context, builder, sig, args):
            elt = context.get_value_type(sig.args[0].dtype)
            size = context.get_abi_sizeof(elt)
            n32 = context.cast(builder, args[2], sig.args[2], _types.uint32)
            asm = _ir.InlineAsm(_ir.FunctionType(_ir.IntType(32), [_ir.IntType(32)]),
                                "mov.b32 $0, $1;", "=r,r")
            off = builder.mul(builder.zext(builder.call(asm, [n32]), _ir.IntType(64)),
                              _ir.Constant(_ir.IntType(64), size))
            addr = builder.add(args[1], off)
            ptr = builder.inttoptr(addr, _ir.PointerType(elt, addrspace=1))
            return builder.load(ptr)
        return ary.dtype(ary, at, n), codegen


if STAMP == 0:
    @cuda.jit(device=True, **INLINE)
    def stamp(slot, second=0):
        """Thread 0's SM clock (``%clock64``) into the stamp buffer's ``slot`` (1-12) for its
        block, where ``STREAMGR_NUMBA_STAMP`` names one: slot 14 (the kernel's start) and 15
        (its end) take ``%globaltimer`` ns, with the clock at slots 0 and 13; ``second`` 1 in the
        second launch of a pair (its own rows, from ``STAMP_SECOND``). Here nothing."""
        return
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _reader(reg):
        @intrinsic
        def read(typingctx):
            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.IntType(64), [])
                return builder.call(ir.InlineAsm(fnty, f"mov.u64 $0, {reg};", "=l",
                                                 side_effect=True), [])
            return types.int64(), codegen
        return read

    _clock, _timer = _reader("%clock64"), _reader("%globaltimer")

    @intrinsic
    def _store(typingctx, addr, val):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(64)])
            builder.call(ir.InlineAsm(fnty, "st.global.u64 [$0], $1;", "l,l",
                                      side_effect=True), list(args))
            return context.get_dummy_value()
        return types.void(addr, val), codegen

    @cuda.jit(device=True, **INLINE)
    def stamp(slot, second=0):
        if cuda.threadIdx.x == 0:
            blk = int64(cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x + second * STAMP_SECOND
            at = int64(STAMP) + (blk * STAMP_SLOTS + slot) * 8
            if slot >= 14:
                _store(at, _timer())
                _store(at - (14 - 12 * (slot - 14)) * 8, _clock())
            else:
                _store(at, _clock())
