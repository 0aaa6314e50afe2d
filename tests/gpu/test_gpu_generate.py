"""GPU: generation in bf16 on CUDA against fp32 on the CPU (top-k agreement; bf16 ties may
reorder)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from streamgr import Engine
from streamgr.api import GenerateRequest

pytestmark = pytest.mark.gpu


def test_bf16_topk_agrees_with_fp32():
    rng = np.random.default_rng(0)
    reqs = [GenerateRequest(user_id=u, history=rng.integers(500, size=int(rng.integers(1, 40))).tolist(),
                            top_k=10) for u in range(32)]

    async def go(ov):
        async with Engine.from_spec("gen-small", ov) as e:
            return await asyncio.gather(*(e.generate(r) for r in reqs))
    cpu = asyncio.run(go({"engine.device": "cpu", "model.dtype": "float32"}))
    gpu = asyncio.run(go({"engine.device": "cuda", "model.dtype": "bfloat16"}))
    overlap = np.mean([len(set(a.items) & set(b.items)) / 10 for a, b in zip(cpu, gpu)])
    print(f"bf16 vs fp32 top-10 overlap: {overlap:.3f}")
    assert overlap > 0.7
