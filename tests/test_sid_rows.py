"""``SidRows`` (a generate answer's SIDs over one array): it reads, compares, pickles and
converts as the list of lists it stands for, and its msgpack is what msgspec decodes to that
list, alone and spliced into a socket reply (``msgspec.Raw``)."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest

from streamgr.protocol import messages as m
from streamgr.runtime.sid_rows import SidRows, enc_hook
from streamgr.server.server import wire_sids


def test_reads_as_its_list_of_lists():
    a = np.array([[3, 0, 8191], [1, 2, 3], [7, 7, 7]], dtype=np.int64)
    rows = SidRows(a[1:])  # a view of a batch's array, as answers hold
    want = [[1, 2, 3], [7, 7, 7]]
    assert len(rows) == 2 and rows[0] == [1, 2, 3] and rows[-1] == [7, 7, 7]
    assert rows[:1] == [[1, 2, 3]] and list(rows) == want and rows.tolist() == want
    assert rows == want and want == rows and rows == [(1, 2, 3), (7, 7, 7)]
    assert rows != [[1, 2, 3]] and rows != [[1, 2, 4], [7, 7, 7]]
    assert rows == SidRows(np.array(want)) and rows != SidRows(np.array(want[:1]))
    assert repr(rows) == repr(want)
    assert np.array_equal(np.asarray(rows), want)
    assert type(rows[0][0]) is int  # Python ints, as tolist gives
    back = pickle.loads(pickle.dumps(rows))
    assert isinstance(back, SidRows) and back == want
    with pytest.raises(TypeError):
        hash(rows)
    with pytest.raises(ValueError, match="items, depth"):
        SidRows(np.zeros(3, dtype=np.int64))


@pytest.mark.parametrize("n,depth,high", [(0, 3, 10), (1, 3, 10), (15, 3, 8192), (16, 4, 2 ** 16),
                                          (300, 3, 2 ** 16 - 1), (70000, 2, 2 ** 20),
                                          (5, 1, 2 ** 31), (17, 15, 100)])
def test_msgpack_decodes_to_the_lists(n, depth, high):
    rng = np.random.default_rng(n + depth)
    a = rng.integers(0, high, size=(n, depth), dtype=np.int64)
    if n:
        a[0, 0] = high - 1  # the widest code is there
    rows = SidRows(a)
    assert msgspec.msgpack.decode(rows.msgpack(), type=list[list[int]]) == a.tolist()
    assert msgspec.msgpack.decode(rows.msgpack()) == a.tolist()


def test_msgpack_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="negative"):
        SidRows(np.array([[1, -1]])).msgpack()
    with pytest.raises(ValueError, match="32 bits"):
        SidRows(np.array([[1, 2 ** 32]])).msgpack()
    with pytest.raises(ValueError, match="16 or more"):
        SidRows(np.zeros((2, 16), dtype=np.int64)).msgpack()


def test_a_reply_with_spliced_rows_decodes_as_one_with_lists():
    a = np.random.default_rng(0).integers(0, 8192, size=(256, 3))
    stats = {"batch_size": 3, "version": "g1"}
    spliced = m.GenerateReply(7, list(range(256)), [0.5] * 256, wire_sids(SidRows(a)), stats)
    plain = m.GenerateReply(7, list(range(256)), [0.5] * 256, a.tolist(), stats)
    assert isinstance(spliced.sids, msgspec.Raw)
    dec = msgspec.msgpack.Decoder(m.Message)
    got = dec.decode(msgspec.msgpack.encode(spliced))
    assert got == dec.decode(msgspec.msgpack.encode(plain)) and got.sids == a.tolist()
    assert wire_sids([[1, 2]]) == [[1, 2]]  # lists (a client's, the CPU path's) as they are


def test_results_encode_with_the_hook_and_decode_as_results():
    """An engine's ``GenerateResult`` (its sids a ``SidRows``) through msgspec's JSON and
    msgpack with ``enc_hook``, decoded back as a ``GenerateResult`` of lists; without the hook
    the encoder says what it cannot encode."""
    import json

    from streamgr.api import GenerateResult, GenerateStats
    stats = GenerateStats(batch_size=1, queue_ms=0.0, compute_ms=1.0, total_ms=1.0)
    rows = SidRows(np.array([[1, 2], [3, 4]]))
    res = GenerateResult(items=[5, 6], scores=[-0.5, -1.0], sids=rows, stats=stats)
    for mod in (msgspec.json, msgspec.msgpack):
        back = mod.decode(mod.Encoder(enc_hook=enc_hook).encode(res), type=GenerateResult)
        assert back.sids == [[1, 2], [3, 4]] and back == res
    with pytest.raises(TypeError, match="SidRows"):
        msgspec.json.encode(res)
    assert json.loads(json.dumps(res.sids, default=enc_hook)) == [[1, 2], [3, 4]]
    for encode in (lambda x: json.dumps(x, default=enc_hook),
                   msgspec.json.Encoder(enc_hook=enc_hook).encode):
        with pytest.raises(TypeError, match="cannot encode object"):
            encode([object()])  # the hook passes on what it does not know
