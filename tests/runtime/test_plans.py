"""Decode plans on the CPU: the shape buckets, and that the padding a plan adds (idle rows,
masked encoder positions) changes no request's answer. Capture and replay themselves need CUDA
(tests/runtime/test_gpu_generate.py)."""

from __future__ import annotations

import numpy as np
import torch

from streamgr import Engine
from streamgr.api import GenerateRequest
from streamgr.runtime.beam import BeamRequest
from streamgr.runtime.plans import PlanCache, bucket_rows


def test_row_buckets():
    assert [bucket_rows(n, 16) for n in (1, 2, 3, 5, 8, 9, 13, 16)] == [1, 2, 4, 8, 8, 12, 16,
                                                                         16]
    # powers of two and 1.5x them from 12: past 8 rows, less than a third of a plan is padding
    want = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    assert sorted({bucket_rows(n, 128) for n in range(1, 129)}) == want
    assert all(bucket_rows(n, 128) < 1.5 * n for n in range(9, 129))
    assert bucket_rows(12, 12) == 12 and bucket_rows(5, 6) == 6  # capped at max_batch
    assert bucket_rows(20, 16) == 20  # a batch over max_batch still gets rows for all


def test_length_buckets_end_at_the_longest_context():
    """Lengths go to multiples of 64, except that the last bucket ends at the policy's longest
    context (rounded to 16): gen-ref's full 769-token contexts run at 784, not 832."""
    def length(plans, n):
        return plans.key([BeamRequest(np.zeros(n, dtype=np.int64), 1, [1])], (1,))[1]
    capped, plain = PlanCache(16, max_length=769), PlanCache(16)
    assert [length(capped, n) for n in (1, 64, 65, 700, 768, 769)] == [64, 64, 128, 704, 768, 784]
    assert [length(plain, n) for n in (1, 700, 769)] == [64, 704, 832]
    assert length(capped, 900) == 960  # past the cap (not a policy's request): plain buckets


def test_padding_changes_no_answer():
    eng = Engine.from_spec("gen-small", {"engine.device": "cpu", "model.dtype": "float32"})
    runner, search = eng.gen_runner, eng.gen_runner.search
    plans = PlanCache(max_rows=16, length_step=64)  # for its shape buckets only
    rng = np.random.default_rng(11)
    ids = runner.trie.leaf_items
    for n in (1, 3, 6):
        reqs = []
        for _ in range(n):
            p = runner.prepare(GenerateRequest(user_id=0, top_k=10, history=rng.choice(
                ids, size=int(rng.integers(0, 40))).tolist()))
            reqs.append(BeamRequest(p.context, p.top_k, [int(rng.integers(1, 20))] * len(p.widths)))
        w = search.step_widths([r.widths for r in reqs])
        rows, length, _ = plans.key(reqs, w)
        assert rows == bucket_rows(n, 16) and length % 64 == 0
        with torch.inference_mode():  # the padded inputs a plan replays, searched eagerly
            want = search.search(*search.inputs(reqs), w)
            got = [x[:n] for x in search.search(*search.inputs(reqs, rows, length), w)]
        for a, b in zip(want, got):
            assert a.shape == b.shape
        np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-5, atol=1e-5)
        finite = torch.isfinite(want[0])
        assert torch.equal(got[1][finite], want[1][finite])
        assert torch.equal(got[2][finite], want[2][finite])


def test_aligned_head_changes_no_answer():
    """The padded head buffer (used on CUDA) gives the same answers, and stays the weights'
    storage: a write to the head's weight is what the next search reads."""
    eng = Engine.from_spec("gen-small", {"engine.device": "cpu", "model.dtype": "float32"})
    runner = eng.gen_runner
    rng = np.random.default_rng(2)
    batch = [runner.prepare(GenerateRequest(user_id=0, top_k=10, history=rng.choice(
        runner.trie.leaf_items, size=20).tolist())) for _ in range(4)]
    before = runner.run(batch).results
    model = runner.model.align_head(64)
    assert model._head_rows.shape[0] % 64 == 0 and model._head_rows.shape[0] > model.cfg.vocab_size
    assert model.state_dict()["shared.weight"].shape[0] == model.cfg.vocab_size
    after = runner.run(batch).results
    for ((ia, sa, _), _), ((ib, sb, _), _) in zip(before, after):
        assert ia == ib
        np.testing.assert_allclose(sa, sb, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.shared.weight.mul_(0.0)  # a flat head: every legal SID now scores the same
    flat = runner.run(batch).results
    (_, scores, _), _ = flat[0]
    np.testing.assert_allclose(scores, scores[0], rtol=1e-6)


def test_inputs_are_the_row_by_row_layout():
    """``BeamSearch.inputs`` builds the batch array-wise; it equals filling row by row."""
    eng = Engine.from_spec("gen-small", {"engine.device": "cpu", "model.dtype": "float32"})
    search, cfg = eng.gen_runner.search, eng.gen_runner.model.cfg
    rng = np.random.default_rng(3)
    reqs = [BeamRequest(rng.integers(3, 50, size=int(rng.integers(1, 90))).astype(np.int64), 5,
                        [int(w) for w in rng.integers(1, 40, size=3)]) for _ in range(7)]
    for n, rows, length in ((7, 8, 128), (3, 3, None), (1, 4, 96)):
        got = search.inputs(reqs[:n], rows, length)
        L = got[0].shape[1]
        tokens = torch.full((rows, L), cfg.pad_token_id, dtype=torch.long)
        mask = torch.zeros(rows, L, dtype=torch.bool)
        cap = torch.zeros(rows, 3, dtype=torch.long)
        tokens[n:, 0], mask[n:, 0] = cfg.eos_token_id, True
        for i, r in enumerate(reqs[:n]):
            tokens[i, :len(r.context)] = torch.from_numpy(r.context)
            mask[i, :len(r.context)] = True
            cap[i] = torch.tensor(r.widths)
        for a, b in zip(got, (tokens, mask, cap)):
            assert a.dtype == b.dtype and torch.equal(a, b)
