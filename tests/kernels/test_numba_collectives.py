"""No Numba device code returns a call to a warp or block collective whose arguments branch.

Why: CPython 3.12 copies a small block that ends in ``return`` into each jump to it. In
``return least_okey(x if c else I32MAX, res)`` the call's tail (load ``res``, call, return)
follows the conditional expression, so 3.12's bytecode holds the call twice, once in each arm
(3.11's holds it once after the arms join). Numba compiles the bytecode as it is: the inlined
shuffles and ``syncthreads`` then sit in both arms of a per-thread branch, the lanes of one warp
wait at different barriers, and the GPU hangs. It hung every launch of the merge kernel through
the sampled floor on the H200 machine (Python 3.12) in sessions 37-39; its PTX held 64
``bar.sync`` for the source's 63, at NVVM's ``-opt=0`` too, so no optimizer was to blame
(session 40). The same source compiles correctly on this machine's Python 3.11, so a compile
check here cannot catch it: this test reads the source instead, on any Python.
"""

from __future__ import annotations

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "streamgr" / "kernels"
# cuda.* calls every lane of a warp (or thread of a block) must reach together
COLLECTIVE = {"syncthreads", "syncwarp", "ballot_sync", "all_sync", "any_sync", "eq_sync",
              "match_any_sync", "match_all_sync", "shfl_sync", "shfl_up_sync",
              "shfl_down_sync", "shfl_xor_sync", "syncthreads_count", "syncthreads_and",
              "syncthreads_or"}


def _name(call: ast.Call) -> str:
    """The name a call names (``f(..)``, ``mod.f(..)``; "" for anything else)."""
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _called(node: ast.AST) -> set[str]:
    """The names a node's calls name."""
    return {_name(n) for n in ast.walk(node) if isinstance(n, ast.Call)}


def _numba(fn: ast.FunctionDef) -> bool:
    """Compiled by Numba CUDA: a ``cuda.jit`` decorator (``@cuda.jit(..)``, ``@cuda.jit``)."""
    return any("cuda.jit" in ast.unparse(d) for d in fn.decorator_list)


def _functions(sources: dict[str, str]):
    """{name: [(file, def)]} of the Numba CUDA functions."""
    found: dict[str, list[tuple[str, ast.FunctionDef]]] = {}
    for name, text in sources.items():
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, ast.FunctionDef) and _numba(fn):
                found.setdefault(fn.name, []).append((name, fn))
    return found


def convergent(sources: dict[str, str]) -> set[str]:
    """Functions (by name) that reach a collective, directly or through calls."""
    fns = _functions(sources)
    calls = {n: set().union(*(_called(f) for _, f in defs)) for n, defs in fns.items()}
    conv = set(COLLECTIVE)
    grew = True
    while grew:
        new = {n for n, c in calls.items() if c & conv} - conv
        conv |= new
        grew = bool(new)
    return conv


def _branches(node: ast.AST) -> bool:
    """The expression holds a conditional expression, ``and``/``or``, or a chained
    comparison: each compiles to jumps."""
    return any(isinstance(n, (ast.IfExp, ast.BoolOp))
               or isinstance(n, ast.Compare) and len(n.ops) > 1 for n in ast.walk(node))


def offenders(sources: dict[str, str]) -> list[str]:
    """``return`` statements whose value calls a convergent function with branching
    arguments (file:line function: statement). Only there has 3.12 been seen to copy the call:
    the tail after the arms carries no line of its own; a ``return`` after an ``if``
    statement keeps its line and its one copy (``dis`` on 3.12.1)."""
    conv = convergent(sources)
    out = []
    for fname, defs in _functions(sources).items():
        for path, fn in defs:
            for ret in ast.walk(fn):
                if not isinstance(ret, ast.Return) or ret.value is None:
                    continue
                for call in ast.walk(ret.value):
                    if not isinstance(call, ast.Call) or _name(call) not in conv:
                        continue
                    args = list(call.args) + [k.value for k in call.keywords]
                    if any(_branches(a) for a in args):
                        out.append(f"{path}:{ret.lineno} {fname}: {ast.unparse(ret)}")
    return out


def _kernel_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(KERNELS.glob("*.py"))}


def test_no_kernel_returns_a_collective_call_with_branching_arguments():
    assert offenders(_kernel_sources()) == []


def test_the_check_finds_the_pattern_that_hung():
    """The session-39 source of ``sample_floor`` is flagged; the same call through a local,
    or with a branch-free argument, is not."""
    dev = "@cuda.jit(device=True, **INLINE)\n"
    lib = (f"{dev}def warp_min_into(m, cell, at):\n    cuda.syncthreads()\n    return cell[at]\n"
           f"{dev}def least_okey(m, res):\n    return warp_min_into(m, res, 3) + 1\n"
           "def host(x):\n    return least_okey(x if x else 1, 2)\n")  # not Numba's: skipped
    hung = f"{dev}def sample_floor(x, b, d, res):\n    return least_okey(x if b >= d else 7, res)\n"
    local = (f"{dev}def sample_floor(x, b, d, res):\n    m = least_okey(x if b >= d else 7, res)\n"
             "    return m\n")
    flat = f"{dev}def sample_floor(x, b, d, res):\n    return least_okey(or_max(b >= d, x), res)\n"
    assert "least_okey" in convergent({"lib.py": lib})
    assert len(offenders({"lib.py": lib, "s.py": hung})) == 1
    assert offenders({"lib.py": lib, "s.py": local}) == []
    assert offenders({"lib.py": lib, "s.py": flat}) == []
    chained = f"{dev}def f(a, b, c, res):\n    return least_okey(a < b < c, res)\n"
    assert len(offenders({"lib.py": lib, "s.py": chained})) == 1
