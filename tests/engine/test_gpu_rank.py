"""GPU: the bf16 CUDA engine agrees with the fp32 CPU reference within bf16 tolerance."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from streamgr import Engine, RankRequest

pytestmark = pytest.mark.gpu


def requests(seed, n, max_hist, num_items, num_actions, n_cand):
    rng = np.random.default_rng(seed)
    return [RankRequest(user_id=u, items=rng.integers(num_items, size=L).tolist(),
                        actions=rng.integers(num_actions, size=L).tolist(),
                        candidates=rng.choice(num_items, size=n_cand, replace=False).tolist())
            for u, L in enumerate(rng.integers(1, max_hist, size=n))]


async def scores(overrides, reqs):
    async with Engine.from_spec("rank-small", overrides) as eng:
        res = await asyncio.gather(*(eng.rank(r) for r in reqs))
    return np.array([r.scores for r in res])


@pytest.mark.parametrize("layers", [2, 4])
async def test_bf16_cuda_matches_fp32_cpu(layers):
    reqs = requests(layers, 16, 512, 1000, 16, 32)
    common = {"model.num_layers": layers, "model.init_seed": 11}
    cpu = await scores({**common, "engine.device": "cpu", "model.dtype": "float32"}, reqs)
    gpu = await scores({**common, "engine.device": "cuda", "model.dtype": "bfloat16"}, reqs)
    err = np.abs(gpu - cpu)
    scale = np.abs(cpu).mean()
    assert err.max() <= 0.05 * max(scale, 1.0) + 0.05, (err.max(), scale)
    # Rankings agree where the fp32 scores are not near-ties.
    corr = np.corrcoef(gpu.ravel(), cpu.ravel())[0, 1]
    assert corr > 0.999


async def test_fp32_cuda_matches_fp32_cpu_tightly():
    reqs = requests(3, 8, 512, 1000, 16, 16)
    cpu = await scores({"engine.device": "cpu", "model.dtype": "float32"}, reqs)
    gpu = await scores({"engine.device": "cuda", "model.dtype": "float32"}, reqs)
    torch.testing.assert_close(torch.from_numpy(gpu), torch.from_numpy(cpu), rtol=2e-3, atol=2e-3)


def test_staged_upload_equals_the_pinned_copy_and_waits_for_its_copy():
    """Rows packed into a page-locked staging buffer upload to the same device tensors as the
    plain path; a buffer whose copy has not completed is not handed out again."""
    from streamgr.engine.rank import UploadStaging, UserSlice, pack_jagged, upload_jagged
    rng = np.random.default_rng(3)
    dev = torch.device("cuda")
    staging = UploadStaging()
    for _ in range(3):
        users = [UserSlice(rng.integers(0, 10**6, int(rng.integers(0, 900))),
                           int(rng.integers(0, 50)), rng.integers(0, 10**6, 16))
                 for _ in range(int(rng.integers(1, 9)))]
        staged, plain = pack_jagged(users, staging), pack_jagged(users)
        assert staged.pinned is not None and staged.pinned.is_pinned()
        a, b = upload_jagged(staged, dev), upload_jagged(plain, dev)
        assert staged.pinned is None  # handed back behind its copy
        for x, y in ((a.token_ids, b.token_ids), (a.is_action, b.is_action),
                     (a.positions, b.positions), (a.candidate_rows, b.candidate_rows)):
            assert torch.equal(x, y)

    class Pending:  # an event not yet complete
        def query(self):
            return False
    one = UploadStaging()
    buf = one.take(10)
    one.give_back(buf, Pending())
    assert one.take(10).data_ptr() != buf.data_ptr()  # a new buffer, not the busy one
    one.give_back(buf, None)
    assert one.take(10).data_ptr() == buf.data_ptr()  # free again: reused
