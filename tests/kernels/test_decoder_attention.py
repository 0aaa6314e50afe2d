"""The decoder's few-key self-attention (kernels/decoder_attention.py): the Numba kernel against
its torch reference under the CUDA simulator on the CPU (a subprocess with
NUMBA_ENABLE_CUDASIM=1), and marked gpu on the device (plain and captured in a CUDA graph);
bad shapes refused."""

from __future__ import annotations

import textwrap

import pytest
import torch

from streamgr.errors import StreamgrError
from streamgr.kernels.decoder_attention import self_attend, self_attend_reference

from .simulator import simulate

CASES = textwrap.dedent("""
    import torch
    from streamgr.kernels.decoder_attention import self_attend, self_attend_reference

    def case(T, L, N, H, d, step, seed, device, impl):
        g = torch.Generator().manual_seed(seed)
        buf = (2 * torch.randn(T, L, N, H, d, generator=g)).to(torch.bfloat16).to(device)
        K, V = buf.clone(), (buf * 0.5).clone()
        K2, V2 = K.clone(), V.clone()
        if seed % 3 == 2:  # q, k, v as column slices of one q|k|v projection (strided rows)
            qkv = (2 * torch.randn(N, 3 * H * d, generator=g)).to(torch.bfloat16).to(device)
            q, kn, vn = (t.view(N, H, d) for t in qkv.chunk(3, dim=-1))
        else:
            q, kn, vn = ((2 * torch.randn(N, H, d, generator=g)).to(torch.bfloat16).to(device)
                         for _ in range(3))
        bias = torch.randn(step + 1, H, generator=g).to(device)
        li = seed % L
        # parent pointers (odd seeds): each earlier position's row drawn from the buffer's
        # rows, repeats included; rows past the beams stay unread
        anc = torch.randint(0, N, (max(step, 1), N), generator=g).to(device) if seed % 2 \
            else None
        out = self_attend(q, kn, vn, K[:, li], V[:, li], step, bias, anc, impl=impl)
        ref = self_attend_reference(q, kn, vn, K2[:, li], V2[:, li], step, bias, anc)
        # the write lands where the reference puts it and nowhere else
        assert torch.equal(K, K2) and torch.equal(V, V2), (T, N, H, d, step)
        err = (out.float() - ref.float()).abs().max().item()
        # fp32 sums in another order, then one bf16 rounding: at most an ulp of the output
        assert err <= 2 ** -7 * max(1.0, ref.abs().max().item()), (T, N, H, d, step, err)
        return err
""")

SIM = CASES + textwrap.dedent("""
    cases = {cases}
    for c in cases:
        case(*c, "cpu", "numba")
    print("ok", len(cases))
""")


@pytest.mark.slow
def test_numba_kernel_under_the_simulator():
    # (T, layers, rows, heads, d, step, seed): first/middle/last step, rows not a multiple of
    # the block (nor even: a half-warp idle), d of 3 quads (lanes idle), one head; seeds 2
    # and 5 read q, k, v as strided slices of one fused projection.
    cases = [(3, 2, 3, 3, 8, 0, 0), (3, 2, 3, 3, 8, 2, 1), (4, 1, 9, 1, 12, 1, 2),
             (5, 3, 3, 1, 64, 4, 3), (3, 1, 5, 2, 128, 1, 5)]  # d = 128: two quads a lane
    assert simulate(SIM.format(cases=cases)) == ["ok", str(len(cases))]


def test_bad_shapes_are_refused():
    q = torch.zeros(4, 2, 8)
    K = torch.zeros(3, 4, 2, 8)
    with pytest.raises(StreamgrError):
        self_attend(q, q, q, K, K, 3, torch.zeros(4, 2))  # step past the buffer
    with pytest.raises(StreamgrError):
        self_attend(q, q, q, torch.zeros(3, 3, 2, 8), torch.zeros(3, 3, 2, 8), 0,
                    torch.zeros(1, 2))  # fewer buffer rows than beams
    with pytest.raises(StreamgrError):
        self_attend(q, q, q, K, K, 2, torch.zeros(3, 2), torch.zeros(1, 4, dtype=torch.long))
    # more buffer rows than beams: the pool a search keeps for its widest step
    assert self_attend(q, q, q, torch.zeros(3, 6, 2, 8), torch.zeros(3, 6, 2, 8), 1,
                       torch.zeros(2, 2), torch.zeros(1, 4, dtype=torch.long)).shape == q.shape
    with pytest.raises(StreamgrError):
        self_attend(q, q, q, K, K, 2, torch.zeros(2, 2))  # bias shorter than step + 1


def test_cpu_fp32_takes_the_reference():
    g = torch.Generator().manual_seed(0)
    K, V = torch.randn(3, 6, 2, 4, generator=g), torch.randn(3, 6, 2, 4, generator=g)
    K2, V2 = K.clone(), V.clone()
    q, kn, vn = (torch.randn(6, 2, 4, generator=g) for _ in range(3))
    bias = torch.randn(2, 2, generator=g)
    out = self_attend(q, kn, vn, K, V, 1, bias)
    assert torch.equal(out, self_attend_reference(q, kn, vn, K2, V2, 1, bias))


@pytest.mark.gpu
def test_numba_kernel_on_the_gpu():
    ns: dict = {}
    exec(CASES, ns)
    for c in [(3, 4, 4096, 8, 64, 0, 0), (3, 4, 4096, 8, 64, 2, 1), (5, 2, 333, 3, 32, 3, 2),
              (3, 1, 1, 1, 128, 1, 3), (3, 4, 4096, 8, 64, 2, 5)]:  # seeds 2, 5: fused
        ns["case"](*c, "cuda", None)


@pytest.mark.gpu
def test_numba_kernel_in_a_cuda_graph():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    K = torch.randn(3, 2, 64, 4, 32, device=dev, generator=g).to(torch.bfloat16)
    V = torch.randn_like(K, dtype=torch.float32).to(torch.bfloat16)
    q, kn, vn = (torch.randn(64, 4, 32, device=dev, generator=g).to(torch.bfloat16)
                 for _ in range(3))
    bias = torch.randn(3, 4, device=dev, generator=g)
    eager = self_attend(q, kn, vn, K[:, 1], V[:, 1], 2, bias).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        self_attend(q, kn, vn, K[:, 1], V[:, 1], 2, bias)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = self_attend(q, kn, vn, K[:, 1], V[:, 1], 2, bias)
    K[2].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(K[2, 1], kn)  # the replay wrote the new key again
