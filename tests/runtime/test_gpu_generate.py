"""GPU: generation on CUDA against Hugging Face's generate on CUDA (fp32: the same top-k; bf16:
top-k agreement, since bf16 ties may reorder) and against fp32 on the CPU."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from streamgr import Engine
from streamgr.api import GenerateRequest
from tests.runtime.helpers import context, write_hf_checkpoint
from tests.runtime.test_beam import hf_topk, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ff,tie,W,k", [("relu", True, 8, 8), ("gated-gelu", False, 16, 5)])
def test_cuda_against_hugging_face(tmp_path, dtype, ff, tie, W, k, monkeypatch):
    from streamgr.models import t5
    monkeypatch.setattr(t5, "_fused_attention_ok", True)
    spec, hf, cat = write_hf_checkpoint(tmp_path, ff=ff, tie=tie, seed=W, n_items=70,
                                        distinct=True,
                                        overrides={"engine.device": "cuda", "model.dtype": dtype})
    hf = hf.to("cuda", getattr(torch, dtype))
    rng = np.random.default_rng(W)
    ctxs = [context(rng, cat, int(n)) for n in (3, 7, 1, 12, 5, 9)]
    hf_sids, hf_scores = hf_topk(hf, cat, [c for _, c in ctxs], W, k)
    got = run(spec, [GenerateRequest(user_id=i, history=items, top_k=k, beam_width=W)
                     for i, (items, _) in enumerate(ctxs)])
    overlap = []
    for i, res in enumerate(got):
        want = hf_sids[i * k:(i + 1) * k]
        if dtype == "float32":
            assert res.sids == want, (i, res.sids, want)
            np.testing.assert_allclose(res.scores, hf_scores[i * k:(i + 1) * k], rtol=1e-3, atol=1e-3)
        overlap.append(len({tuple(s) for s in res.sids} & {tuple(s) for s in want}) / len(want))
    print(f"{dtype} W={W} k={k}: top-{k} agreement with Hugging Face {np.mean(overlap):.3f}")
    assert np.mean(overlap) >= (1.0 if dtype == "float32" else 0.75)
    assert t5._fused_attention_ok, "bf16 fell back from the fused attention kernel"


def test_bf16_topk_agrees_with_fp32_cpu():
    rng = np.random.default_rng(0)
    reqs = [GenerateRequest(user_id=u, history=rng.integers(500, size=int(rng.integers(1, 40))).tolist(),
                            top_k=10) for u in range(32)]

    async def go(ov):
        async with Engine.from_spec("gen-small", ov) as e:
            return await asyncio.gather(*(e.generate(r) for r in reqs))
    cpu = asyncio.run(go({"engine.device": "cpu", "model.dtype": "float32"}))
    gpu = asyncio.run(go({"engine.device": "cuda", "model.dtype": "bfloat16"}))
    overlap = np.mean([len(set(a.items) & set(b.items)) / 10 for a, b in zip(cpu, gpu)])
    print(f"bf16 (CUDA) vs fp32 (CPU) top-10 overlap: {overlap:.3f}")
    assert overlap > 0.7
    # Each CUDA batch's GPU time (its span on the stream) in its answers' stages, none on the
    # CPU; the engine sums it per batch (the busy share bench_generate prints).
    assert all(r.stats.steps.get("gpu", 0) > 0 for r in gpu)
    assert all("gpu" not in r.stats.steps for r in cpu)


def test_gpu_busy_time_is_counted_per_batch():
    reqs = [GenerateRequest(user_id=u, history=[1, 2, 3], top_k=5) for u in range(40)]

    async def go():
        async with Engine.from_spec("gen-small", {"engine.device": "cuda"}) as e:
            res = await asyncio.gather(*(e.generate(r) for r in reqs))
            return res, e.stats()["counters"]["generate_gpu_us"]
    res, busy_us = asyncio.run(go())
    spans = {id(r.stats.steps): r.stats.steps["gpu"] for r in res}  # one dict per batch
    assert busy_us == pytest.approx(sum(int(v * 1e3) for v in spans.values()), abs=len(spans))


@pytest.mark.parametrize("R,Q,S", [(3, 1, 16), (4, 256, 784), (2, 37, 48)])
def test_fused_attention_equals_reference(R, Q, S, monkeypatch):
    """The memory-efficient kernel (bf16 bias) against the fp32-softmax reference, with padded
    keys masked as the encoder and cross-attention mask them; a bias laid out as the relative
    position embedding gives it (key dimension not at stride 1) included."""
    from streamgr.models import t5
    monkeypatch.setattr(t5, "_fused_attention_ok", True)
    g = torch.Generator(device="cuda").manual_seed(R * Q)
    q, k, v = (torch.randn(R, 8, n, 64, device="cuda", generator=g).bfloat16() for n in (Q, S, S))
    keep = torch.arange(S, device="cuda")[None, :] < torch.tensor([S - 5 * i for i in range(R)],
                                                                 device="cuda")[:, None]
    bias = torch.randn(1, Q, S, 8, device="cuda", generator=g).permute(0, 3, 1, 2)
    bias = bias + torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    q = q * 0.125  # T5 folds 1/sqrt(d) into its weights: logits of a trained model's size
    ref = t5.attend(q.float(), k.float(), v.float(), bias, fuse=False)  # all fp32
    got = t5.attend(q, k, v, bias.bfloat16()).float()
    got_strided = t5.attend(q, k, v, bias.bfloat16().transpose(-1, -2).contiguous().transpose(-1, -2))
    assert t5._fused_attention_ok, "the memory-efficient kernel refused these shapes"
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_strided.float(), got)


def _batches(runner, rng, sizes, own_width=()):
    """Batches (of requests) of the given sizes: random histories, top-k up to gen-small's last
    width (32: a larger one widens the last step, another plan key); the batches numbered in
    ``own_width`` have requests that set their own beam width (another plan key)."""
    ids = runner.trie.leaf_items
    return [[GenerateRequest(user_id=0, history=rng.choice(ids, size=int(rng.integers(0, 60))).tolist(),
                             top_k=int(rng.integers(1, 33)),
                             beam_width=int(rng.integers(1, 30)) if i in own_width else None)
             for _ in range(n)] for i, n in enumerate(sizes)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_plans_equal_eager_search(dtype):
    """Captured plans against the eager search on the same batches: fp32 the same answers;
    bf16 (fused attention, padding to other shapes) the same up to near-ties. Shapes repeat
    with new inputs, so a replay that returned a previous batch's outputs would show."""
    ov = {"engine.device": "cuda", "model.dtype": dtype}
    eager = Engine.from_spec("gen-small", {**ov, "engine.decode_plans": 0}).gen_runner
    planned_engine = Engine.from_spec("gen-small", ov)
    planned = planned_engine.gen_runner
    assert eager.search.plans is None and planned.search.plans is not None
    rng = np.random.default_rng(5)
    batches = _batches(planned, rng, [5, 16, 3, 5, 16, 1, 7], own_width=(2, 5))
    overlap = []
    for batch in batches:  # each runner prepares its own (a request binds to its version)
        a = eager.run([eager.prepare(r) for r in batch]).results
        b = planned.run([planned.prepare(r) for r in batch]).results
        assert not any(isinstance(x, Exception) for x in a + b)
        for ((ia, sa, da), _), ((ib, sb, db), _) in zip(a, b):
            if dtype == "float32":
                assert ia == ib and da == db
                np.testing.assert_allclose(sa, sb, rtol=1e-4, atol=1e-4)
            overlap.append(len(set(ia) & set(ib)) / max(len(ia), 1))
    st = planned.search.plans.stats()
    print(f"{dtype}: plans {st}, top-k overlap with eager {np.mean(overlap):.3f}")
    assert st["enabled"] and st["replays"] == len(batches)
    assert st["captures"] < len(batches)  # shapes were reused
    assert np.mean(overlap) >= (1.0 if dtype == "float32" else 0.9)
    # A new version (new weights) brings its own plans: a graph holds its version's tensors.
    new = planned_engine._build_generate(7, None, None)
    assert new.search.plans is not planned.search.plans
    new.warm_up(planned.active.plan_keys())  # the shapes the traffic used, captured up front
    assert new.search.plans.stats()["captures"] == len(planned.active.plan_keys()) > 0
