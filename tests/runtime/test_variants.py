"""Selection variants (runtime/variants.py): per-request narrowing widths, a deny list that
still answers top_k items, prefix diversity; bad values refused with typed errors; the same
over the socket. Real engines on the CPU (gen-small, fp32)."""

from __future__ import annotations

import numpy as np
import pytest

from streamgr import Engine
from streamgr.api import GenerateRequest
from streamgr.client import AsyncClient
from streamgr.errors import IdOutOfRange, InvalidRequest
from streamgr.runtime.variants import keep_mask
from streamgr.server import Server

GEN = {"engine.device": "cpu", "model.dtype": "float32"}


def test_keep_mask_rows_excludes_and_caps():
    row = np.array([0, 0, 0, 0, 1, 1, 1])
    items = np.array([5, 6, 7, 8, 5, 6, 7])
    prefix = np.array([1, 1, 2, 1, 3, 3, 3])
    got = keep_mask(row, items, prefix, [np.array([6]), None], [0, 0])
    assert got.tolist() == [True, False, True, True, True, True, True]
    got = keep_mask(row, items, prefix, [None, None], [1, 2])
    assert got.tolist() == [True, False, True, False, True, True, False]
    # exclusion first, then the cap counts only what survived it
    got = keep_mask(row, items, prefix, [np.array([5]), np.array([6])], [1, 1])
    assert got.tolist() == [False, True, True, False, True, False, False]


async def test_variants_through_the_engine():
    async with Engine.from_spec("gen-small", GEN) as eng:
        ids = eng.gen_runner.catalog_items
        hist = np.random.default_rng(0).choice(ids, 10).tolist()
        base = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=20,
                                                  beam_width=64))
        deny = base.items[:5]
        r = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=20,
                                               beam_width=64, exclude_items=deny))
        assert len(r.items) == 20 and not set(r.items) & set(deny)
        assert r.items[:15] == base.items[5:]  # the rest of the ranking, in order
        d = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=10,
                                               beam_width=64, max_per_prefix=1))
        firsts = [s[0] for s in d.sids]
        assert len(set(firsts)) == len(firsts) and 1 <= len(firsts) <= 10
        assert d.items[0] == base.items[0]
        same = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=20,
                                                  beam_widths=[64, 64, 64]))
        assert same.items == base.items
        narrow = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=8,
                                                    beam_widths=[32, 16, 8]))
        assert len(narrow.items) == 8
        for bad in ({"beam_widths": [8, 8]}, {"beam_widths": [8, 8, 0]},
                    {"beam_widths": [8, 8, 8], "beam_width": 8}, {"exclude_items": "x"},
                    {"exclude_items": [1.5]}, {"max_per_prefix": -1},
                    {"exclude_items": list(range(5000))}):
            with pytest.raises(InvalidRequest):
                await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=5, **bad))
        with pytest.raises(InvalidRequest, match="user_id"):  # the rank path's bounds too
            await eng.generate(GenerateRequest(user_id="u" * 1025, history=hist, top_k=5))
        assert (await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=5))).items


async def test_beams_past_the_selection_limit_are_refused_not_failed_in_a_batch():
    """A step keeps at most ``MAX_BEAMS`` beams (the selection kernels' largest k): a wider
    ``beam_width`` / ``beam_widths`` is a typed ``InvalidRequest`` at admission, and the requests
    batched beside it are answered (it used to fail its whole batch inside the selection)."""
    import asyncio
    from streamgr.config import MAX_BEAMS
    from streamgr.kernels.trie_topk import MAX_K
    assert MAX_BEAMS == MAX_K
    async with Engine.from_spec("gen-small", GEN) as eng:
        hist = np.random.default_rng(0).choice(eng.gen_runner.catalog_items, 10).tolist()
        good = GenerateRequest(user_id=1, history=hist, top_k=5)
        for bad in ({"beam_width": MAX_BEAMS + 1}, {"beam_widths": [8, MAX_BEAMS + 1, 8]}):
            got = await asyncio.gather(
                eng.generate(good),
                eng.generate(GenerateRequest(user_id=2, history=hist, top_k=5, **bad)),
                eng.generate(good), return_exceptions=True)
            assert isinstance(got[1], InvalidRequest) and str(MAX_BEAMS) in str(got[1]), got[1]
            assert got[0].items and got[2].items == got[0].items
        wide = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=5,
                                                  beam_width=MAX_BEAMS))
        assert len(wide.items) == 5


async def test_policy_diversity_default_and_request_override():
    async with Engine.from_spec("gen-small", {**GEN, "policy.max_per_prefix": 1}) as eng:
        hist = eng.gen_runner.catalog_items[:6].tolist()
        r = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=10))
        assert len({s[0] for s in r.sids}) == len(r.sids)
        off = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=10,
                                                 max_per_prefix=0))
        assert len(off.items) == 10


async def test_variants_over_the_socket():
    async with Engine.from_spec("gen-small", GEN) as eng:
        srv = Server(eng)
        addr = (await srv.start("127.0.0.1", 0))[0]
        req = GenerateRequest(user_id=2, history=[1, 2, 3], top_k=6, exclude_items=[1, 2, 3],
                              max_per_prefix=2, beam_widths=[16, 16, 16])
        want = await eng.generate(req)
        async with AsyncClient(addr) as c:
            got = await c.generate(req)
        await srv.shutdown(1.0)
    assert got.items == want.items and not {1, 2, 3} & set(got.items)


async def test_numpy_ints_and_tuples_are_taken_as_lists_and_ints_embedded_and_remote():
    """Ids and sizes from numpy (``np.int64`` scalars, int arrays) or tuples answer as the same
    request in lists and ints do, embedded and over the socket (the deny list and per-step
    widths were refused, and numpy scalars refused or unencodable)."""
    async with Engine.from_spec("gen-small", GEN) as eng:
        plain = GenerateRequest(user_id=3, history=[1, 2, 3], top_k=6, exclude_items=[1, 2],
                                max_per_prefix=3, beam_widths=[16, 8, 8])
        numpy = GenerateRequest(user_id=3, history=np.array([1, 2, 3]), top_k=np.int64(6),
                                exclude_items=np.array([1, 2], dtype=np.int32),
                                max_per_prefix=np.int16(3), beam_widths=(16, np.int64(8), 8))
        want = await eng.generate(plain)
        assert want.items  # (max_per_prefix may cut it below top_k: README)
        assert (await eng.generate(numpy)).items == want.items
        one = GenerateRequest(user_id=3, history=[1, 2, 3], top_k=np.int32(6),
                              beam_width=np.int64(16))
        assert (await eng.generate(one)).items == \
            (await eng.generate(GenerateRequest(user_id=3, history=[1, 2, 3], top_k=6,
                                                beam_width=16))).items
        huge = GenerateRequest(user_id=3, history=np.array([1, 2**63], dtype=np.uint64), top_k=5)
        with pytest.raises(IdOutOfRange, match="holds id 9223372036854775808,"):  # as sent
            await eng.generate(huge)
        srv = Server(eng)
        addr = (await srv.start("127.0.0.1", 0))[0]
        async with AsyncClient(addr) as c:
            got = await c.generate(numpy)
            with pytest.raises(IdOutOfRange, match="holds id 9223372036854775808,"):
                await c.generate(huge)
        await srv.shutdown(1.0)
    assert got.items == want.items


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_top_k_items_come_back_when_the_widths_are_narrower(device):
    """A last step narrower than ``top_k`` (the request's widths or the policy's) keeps
    ``top_k`` beams: the answer is the one of asking for that last width, ``top_k`` items where
    the trie's leaves under the previous step's beams allow (gen-small: 8 under two beams, 11
    under four), never just the narrower width's count (the old answer, silently short)."""
    ov = {**GEN, "engine.device": device, "policy.beam_widths": [4, 4, 4]}
    async with Engine.from_spec("gen-small", ov) as eng:
        ids = eng.gen_runner.catalog_items
        hist = np.random.default_rng(3).choice(ids, 8).tolist()
        for asked, same, n in [({"beam_width": 2}, [2, 2, 12], 8), ({}, [4, 4, 12], 11),
                               ({"beam_widths": [8, 6, 3]}, [8, 6, 12], 12)]:
            got = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=12, **asked))
            want = await eng.generate(GenerateRequest(user_id=1, history=hist, top_k=12,
                                                      beam_widths=same))
            assert len(got.items) == len(set(got.items)) == n, asked
            assert got.items == want.items and got.scores == want.scores, asked
