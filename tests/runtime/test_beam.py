"""Beam search against exhaustive search and against Hugging Face's generate (CPU, fp32)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from streamgr import Engine
from streamgr.api import GenerateRequest
from streamgr.errors import ContractError, IdOutOfRange, InvalidRequest, SpecError
from tests.runtime.helpers import CODEBOOKS, OFFSET, context, write_hf_checkpoint


def sid_logprob(model, ctx_tokens, sid):
    """Teacher-forced summed log-probability of one SID (the exhaustive reference)."""
    tok = torch.tensor([ctx_tokens])
    mask = torch.ones_like(tok, dtype=torch.bool)
    cross = model.cross_kv(model.encode(tok, mask))
    cfg = model.cfg
    K = torch.zeros(len(sid), cfg.decoder_layers, 1, cfg.num_heads, cfg.d_kv)
    V = torch.zeros_like(K)
    total, step_tok = 0.0, 0
    offs = np.cumsum([OFFSET] + CODEBOOKS[:-1])
    for t, code in enumerate(sid):
        lp = model.decode_step(torch.tensor([step_tok]), t, K, V, cross, mask, 1)
        step_tok = int(offs[t] + code)
        total += float(lp[0, step_tok])
    return total


def run(engine_spec, reqs):
    async def go():
        async with Engine.from_spec(engine_spec) as e:
            return await asyncio.gather(*(e.generate(r) for r in reqs))
    return asyncio.run(go())


def test_wide_beam_equals_exhaustive(tmp_path):
    spec, _, cat = write_hf_checkpoint(tmp_path, n_items=40, distinct=True)
    rng = np.random.default_rng(0)
    items, ctx = context(rng, cat, 5)
    eng = Engine(spec)
    model = eng.gen_runner.model
    exhaustive = sorted(((sid_logprob(model, ctx, s.tolist()), int(i)) for i, s in
                         zip(cat.item_ids, cat.sids)), reverse=True)
    [res] = run(spec, [GenerateRequest(user_id=1, history=items, top_k=10, beam_width=120)])
    assert res.items == [i for _, i in exhaustive[:10]]
    np.testing.assert_allclose(res.scores, [s for s, _ in exhaustive[:10]], rtol=1e-5, atol=1e-5)


def hf_topk(hf, cat, ctx_batch, W, k):
    """Hugging Face beam search with the trie as prefix_allowed_tokens_fn, no length penalty."""
    offs = np.cumsum([OFFSET] + CODEBOOKS[:-1])
    children: dict[tuple, set] = {}
    for s in cat.sids.tolist():
        for t in range(len(s)):
            children.setdefault(tuple(s[:t]), set()).add(int(offs[t] + s[t]))

    def allowed(batch_id, input_ids):
        prefix = input_ids.tolist()[1:]
        codes = tuple(int(x - offs[t]) for t, x in enumerate(prefix))
        return sorted(children.get(codes, {1}))
    S = max(len(c) for c in ctx_batch)
    ids = torch.zeros(len(ctx_batch), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(ctx_batch):
        ids[i, :len(c)] = torch.tensor(c)
        mask[i, :len(c)] = 1
    out = hf.generate(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device), num_beams=W, num_return_sequences=k,
                      max_new_tokens=len(CODEBOOKS), prefix_allowed_tokens_fn=allowed,
                      length_penalty=0.0, do_sample=False, early_stopping=False,
                      output_scores=True, return_dict_in_generate=True)
    seqs = out.sequences[:, 1:].tolist()
    sids = [[int(x - offs[t]) for t, x in enumerate(s)] for s in seqs]
    return sids, out.sequences_scores.tolist()


@pytest.mark.parametrize("ff,tie,W,k", [("relu", True, 4, 3), ("relu", True, 8, 8),
                                        ("gated-gelu", False, 16, 5)])
def test_same_topk_as_hugging_face(tmp_path, ff, tie, W, k):
    spec, hf, cat = write_hf_checkpoint(tmp_path, ff=ff, tie=tie, seed=W, n_items=70, distinct=True)
    rng = np.random.default_rng(W)
    ctxs = [context(rng, cat, int(n)) for n in (3, 7, 1)]
    hf_sids, hf_scores = hf_topk(hf, cat, [c for _, c in ctxs], W, k)
    got = run(spec, [GenerateRequest(user_id=i, history=items, top_k=k, beam_width=W)
                     for i, (items, _) in enumerate(ctxs)])
    for i, res in enumerate(got):
        assert res.sids == hf_sids[i * k:(i + 1) * k], (i, res.sids, hf_sids[i * k:(i + 1) * k])
        np.testing.assert_allclose(res.scores, hf_scores[i * k:(i + 1) * k], rtol=1e-4, atol=1e-4)


def test_batch_equals_alone_and_no_illegal_sid(tmp_path):
    spec, _, cat = write_hf_checkpoint(tmp_path, n_items=80)
    legal = {tuple(s) for s in cat.sids.tolist()}
    rng = np.random.default_rng(3)
    reqs = []
    for u in range(40):
        items, _ = context(rng, cat, int(rng.integers(0, 12)))
        reqs.append(GenerateRequest(user_id=u, history=items, top_k=int(rng.integers(1, 12)),
                                    beam_width=None if u % 2 else int(rng.integers(1, 20))))
    together = run(spec, reqs)
    alone = [run(spec, [r])[0] for r in reqs[:10]]
    for a, b in zip(alone, together[:10]):
        assert a.items == b.items and a.sids == b.sids
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5, atol=1e-5)
    assert max(r.stats.batch_size for r in together) > 1
    for r, req in zip(together, reqs):
        assert len(r.items) <= req.top_k and all(tuple(s) in legal for s in r.sids)
        assert r.scores == sorted(r.scores, reverse=True)


def test_bad_generate_input_keeps_serving(tmp_path):
    spec, _, cat = write_hf_checkpoint(tmp_path)

    async def go():
        async with Engine.from_spec(spec) as e:
            for bad, err in [(dict(history=[10**9]), IdOutOfRange), (dict(top_k=0), InvalidRequest),
                             (dict(beam_width=0), InvalidRequest),
                             (dict(history=["x"]), InvalidRequest)]:
                with pytest.raises(err):
                    await e.generate(GenerateRequest(**{**dict(user_id=1, history=[],
                                                               top_k=3), **bad}))
            return await e.generate(GenerateRequest(user_id=1, history=[], top_k=3))
    assert len(asyncio.run(go()).items) == 3


def test_contract_mismatches_name_the_field(tmp_path):
    spec, _, _ = write_hf_checkpoint(tmp_path, vocab=OFFSET + sum(CODEBOOKS) - 2)
    with pytest.raises(ContractError, match="vocabulary.vocab_size"):
        Engine(spec)
    spec, _, _ = write_hf_checkpoint(tmp_path)
    from safetensors.torch import load_file, save_file
    w = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    w.pop("decoder.block.1.layer.2.DenseReluDense.wo.weight")
    save_file(w, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(ContractError, match=r"weights.decoder.block.1.layer.2.DenseReluDense.wo.weight"):
        Engine(spec)
    spec, _, _ = write_hf_checkpoint(tmp_path)
    (tmp_path / "catalog.csv").write_text("item_id,s1,s2,s3\n1,0,0,0\n2,0,9,0\n")
    with pytest.raises(ContractError, match=r"catalog.s2"):
        Engine(spec)
    (tmp_path / "catalog.csv").write_text("item_id,s1,s2\n1,0,0\n")
    with pytest.raises(ContractError, match=r"catalog.codebook_sizes"):
        Engine(spec)
    with pytest.raises(SpecError, match=r"policy.beam_widths"):
        from streamgr.config import load_spec
        load_spec("gen-small", {"policy.beam_widths": [4, 4]})


@pytest.mark.parametrize("policy", ["all", "first"])
def test_sid_policy_for_items_sharing_a_sid(tmp_path, policy):
    import msgspec
    spec, _, cat = write_hf_checkpoint(tmp_path, n_items=30, distinct=True)
    # Items 1000 and 1001 share the SID of catalog row 0; catalog order puts 1000 first.
    rows = ["item_id,s1,s2,s3"] + [f"{i},{a},{b},{c}" for i, (a, b, c) in
                                   zip(cat.item_ids, cat.sids.tolist())]
    a, b, c = cat.sids[0].tolist()
    rows += [f"1000,{a},{b},{c}", f"1001,{a},{b},{c}"]
    (tmp_path / "catalog.csv").write_text("\n".join(rows) + "\n")
    spec = msgspec.structs.replace(spec, catalog=msgspec.structs.replace(spec.catalog,
                                                                          sid_policy=policy))
    [res] = run(spec, [GenerateRequest(user_id=1, history=[], top_k=40, beam_width=120)])
    shared = [i for i, s in zip(res.items, res.sids) if s == [a, b, c]]
    assert shared == ([int(cat.item_ids[0]), 1000, 1001] if policy == "all" else [int(cat.item_ids[0])])
    assert len(res.items) == len(set(res.items))


def test_close_mid_flight_answers_or_refuses_every_request():
    """Generate batches are pipelined (submitted, then answered on a completion thread); a
    close that does not wait must still settle every admitted request: an answer or
    EngineClosed, never a future left hanging."""
    from streamgr.errors import EngineClosed
    rng = np.random.default_rng(4)

    async def go():
        eng = Engine.from_spec("gen-small", {"engine.device": "cpu", "engine.max_batch": 4})
        await eng.start()
        ids = eng.gen_runner.trie.leaf_items
        futs = [eng.submit_generate(GenerateRequest(user_id=u, top_k=5, history=rng.choice(
            ids, size=30).tolist())) for u in range(40)]
        await futs[0]  # one batch answered; the rest in flight or queued
        await eng.close(drain_timeout=0.0)
        return await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
    out = asyncio.run(go())
    answered = [r for r in out if not isinstance(r, Exception)]
    refused = [r for r in out if isinstance(r, Exception)]
    assert all(isinstance(r, EngineClosed) for r in refused), refused[:3]
    assert all(len(r.items) == 5 for r in answered)
    assert answered and refused  # the close really fell mid-flight


@pytest.mark.parametrize("ks", [[1, 5, 40, 100, 3, 17, 64], [1, 5, 12, 3, 9, 17, 2]],
                         ids=["some_k_past_the_beams", "every_k_below_the_beams"])
@pytest.mark.parametrize("policy", ["all", "first"])
def test_batch_answer_equals_row_by_row(policy, ks):
    """The batch-wide answer assembly gives each request what the per-request one gives:
    random final beams, dead (-inf) tails and whole dead rows, different top-k, shared SIDs;
    where every top-k is below the beams it reads only the first max(top-k) beams."""
    from streamgr.runtime.beam import BeamSearch
    from streamgr.selection.vocabulary import SidTrie
    from streamgr.selection.catalog import random_catalog
    rng = np.random.default_rng(5)
    cat = random_catalog(3000, [8, 8, 8], seed=2, distinct=False)  # some SIDs name several items
    trie = SidTrie(cat, [8, 8, 8], 3)
    bs = BeamSearch.__new__(BeamSearch)
    bs.trie, bs.policy = trie, policy
    R, W = 7, 40
    leaves = rng.integers(0, len(trie.leaf_ptr) - 1, size=(R, W))
    scores = -np.sort(rng.random((R, W)).astype(np.float32), axis=1)
    scores[2, 25:] = -np.inf
    scores[4] = -np.inf
    codes = trie.leaf_sids[leaves]
    want = [bs.answer(scores[i], leaves[i], codes[i], k) for i, k in enumerate(ks)]
    got = bs.answer_batch(scores, leaves, codes, ks)
    # the SIDs (SidRows over the batch's array, read only below) do not alias the codes they
    # came from: a readback buffer the next batch overwrites leaves answers as they were
    codes[:] = -1
    assert got == want and all(type(a[2]).__name__ == "SidRows" for a in got)
    assert want[4] == ([], [], [])
    assert [len(a[0]) for a in want][:2] == [1, 5]
    if ks[3] == 100:  # "all": a SID shared by several items gives them all (more than beams)
        assert (len(want[3][0]) > 40) if policy == "all" else (len(want[3][0]) == 40)
