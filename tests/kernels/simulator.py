"""Numba CUDA kernels run under the CUDA simulator on the CPU, each script in a process of its
own (``NUMBA_ENABLE_CUDASIM`` and the kernels' A/B settings are read at import).

The simulator (numba-cuda 0.30) runs a block's threads as Python threads while its manager
thread polls their ``syncthreads_blocked`` flags in a loop that holds the GIL, so the threads
run only when the interpreter switches away from it (every 5 ms): the time went to the
manager's spinning (merge cases 26.2 s; at a 50 ms switch interval 185.9 s). ``PRELUDE`` makes
that flag a property whose read yields the GIL (``time.sleep(0)``): alone on this 2-core VM the
merge process 37.9 -> 14.6 s, the grid one 59.6 -> 18.4 s, the one-block one 49.6 -> 14.9 s
(session 46). A shorter switch interval instead was erratic (the levels script 15.5 s at 5 ms,
48.3 s at 0.1 ms, 222.2 s at 1 ms). Where a later simulator reads no such flag, the property
goes unread: slower, never wrong."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRELUDE = """
import time


def _blocked(self):  # read by the block manager's polling loop: yield the GIL there
    time.sleep(0)
    return self.__dict__.get("_sim_blocked", False)


def _set_blocked(self, v):
    self.__dict__["_sim_blocked"] = v


try:  # a simulator laid out otherwise runs as it is (slower, as correct)
    from numba.cuda.simulator import kernel as _k
    _k.BlockThread.syncthreads_blocked = property(_blocked, _set_blocked)
except (ImportError, AttributeError):
    pass
"""


def simulate(script: str, **env) -> list[str]:
    """``script`` (Python source) run under the simulator with ``env`` added, in the repository
    root; its stdout's words, after asserting it exited 0."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", **env)
    p = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split()
