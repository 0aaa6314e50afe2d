"""A generate request's preparation runs on the event loop, beside the executor's and the
completion threads' Python: it must never let the GIL go, because getting it back waits for
whichever thread runs Python then, up to the switch interval (5 ms) per release
(docs/benchmarks.md, sessions 13-14). A thread counting in Python only advances while the GIL
is free, so its count across a run of ``prepare`` calls says whether any of them released it."""

from __future__ import annotations

import numpy as np

from streamgr import Engine
from streamgr.api import GenerateRequest
from tests.gil import assert_keeps_the_gil, rounds_that_let_the_gil_go


# gen-ref's catalog (a million items) and 256-item histories, a model too small to matter: numpy
# decides whether an operation lets the GIL go by its size, so the sizes must be gen-ref's.
TINY = {"engine.device": "cpu", "model.num_layers": 1, "model.num_decoder_layers": 1,
        "model.model_dim": 16, "model.num_heads": 1, "model.head_dim": 16, "model.d_ff": 16,
        "model.dtype": "float32", "engine.refit_spare": False}


def test_prepare_never_lets_the_gil_go():
    eng = Engine.from_spec("gen-ref", TINY)
    v = eng.gen_runner.active
    assert v.index.packed is not None  # the packed context table, as gen-ref serves it
    rng = np.random.default_rng(0)
    n = min(256, v.policy.max_context_items)
    reqs = [GenerateRequest(user_id=u, history=rng.choice(v.item_ids, n).tolist(), top_k=4)
            for u in range(200)]
    last = []

    def prepare_20(k):
        for r in reqs[k * 20:(k + 1) * 20]:
            last[:] = [v.prepare(r)]
    advanced = rounds_that_let_the_gil_go(prepare_20, 10)
    assert len(last[0].context) == n * v.trie.depth + 1
    assert_keeps_the_gil(advanced)
