"""T5's RMS norm for bf16 CUDA activations (kernels/rms_norm.py): the Numba kernel against the
fp32 reference under the CUDA simulator on the CPU (a subprocess with NUMBA_ENABLE_CUDASIM=1),
and marked gpu on the device (against the reference and ``F.rms_norm``, and captured in a CUDA
graph); what it refuses."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from streamgr.errors import StreamgrError
from streamgr.kernels.rms_norm import rms_norm

from .simulator import simulate

CASES = textwrap.dedent("""
    import torch
    from streamgr.kernels.rms_norm import rms_norm, rms_norm_reference

    def case(rows, d, seed, device):
        g = torch.Generator().manual_seed(seed)
        x = (3 * torch.randn(rows, d, generator=g)).to(torch.bfloat16).to(device)
        w = (1 + 0.5 * torch.randn(d, generator=g)).to(torch.bfloat16).to(device)
        got = rms_norm(x, w, 1e-6, impl="numba")
        want = rms_norm_reference(x, w, 1e-6)
        # fp32 sums in another order, then one bf16 rounding: at most an ulp apart
        err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
        assert got.shape == x.shape and got.dtype == x.dtype
        assert err.max().item() <= 2 ** -7, (rows, d, err.max().item())
        return got
""")

SIM = CASES + textwrap.dedent("""
    for c in {cases}:
        case(*c, "cpu")
    print("ok")
""")


def test_numba_kernel_under_the_simulator():
    # (rows, d, seed): rows not a multiple of a block's warps, one quad a row, several quads a
    # lane (d past 4 x 32)
    cases = [(3, 8, 0), (5, 4, 1), (2, 144, 2), (9, 512, 3)]
    assert simulate(SIM.format(cases=cases)) == ["ok"]


def test_what_the_kernel_does_not_take_goes_to_torch():
    x, w = torch.randn(4, 6), torch.ones(6)  # fp32 on the CPU, rows of 6
    assert torch.equal(rms_norm(x, w, 1e-6, impl="numba"), F.rms_norm(x, (6,), w, 1e-6))
    with pytest.raises(StreamgrError):
        rms_norm(x, torch.ones(5), 1e-6)


@pytest.mark.gpu
def test_numba_kernel_on_the_gpu_and_in_a_graph():
    ns: dict = {}
    exec(CASES, ns)
    for c in [(8192, 512, 0), (25088, 512, 1), (32, 512, 2), (7, 64, 3), (1, 4, 4)]:
        got = ns["case"](*c, "cuda")
    x = torch.randn(3, 77, 512, device="cuda").to(torch.bfloat16)
    w = torch.randn(512, device="cuda").to(torch.bfloat16)
    ref = F.rms_norm(x, (512,), w, 1e-6)
    eager = rms_norm(x, w, 1e-6, impl="numba")
    assert ((eager.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-3).all()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rms_norm(x, w, 1e-6, impl="numba")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = rms_norm(x, w, 1e-6, impl="numba")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, eager)
