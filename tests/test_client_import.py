"""The thin client: ``streamgr.client`` and the request types import without torch, numpy,
numba or CuPy (a client-only install), and the embedded engine still imports on demand."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "numpy", "numba", "cupy"):
                raise ImportError("blocked: " + name)
    sys.meta_path.insert(0, Block())
    import streamgr.client
    from streamgr import GenerateRequest, GenerateResult, RankRequest, RankResult
    from streamgr.client import AsyncClient, Client
    from streamgr.errors import ServerUnavailable
    assert not any(m.split(".")[0] in ("torch", "numpy") for m in sys.modules)
    try:
        Client("127.0.0.1:1")
    except ServerUnavailable as err:
        assert "127.0.0.1:1" in str(err) and "no streamgr server answers" in str(err), err
    else:
        raise SystemExit("connected to nothing?")
    print("ok")
""")


def test_client_imports_without_torch_or_numpy():
    p = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


def test_engine_is_still_exported():
    import streamgr
    assert streamgr.Engine.__name__ == "Engine" and streamgr.BlockingEngine.__name__ == "BlockingEngine"
