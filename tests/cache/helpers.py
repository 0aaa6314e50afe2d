"""Runners of every cache mode over one set of weights, driven synchronously batch by batch."""

from __future__ import annotations


from streamgr import RankRequest
from streamgr.config import load_spec
from streamgr.engine.core import Engine
from streamgr.engine.rank import prepare_rank

MODES = ("recompute", "gpu-only", "hierarchical")


def tiny_spec(device="cpu", dtype="float32", model=None, **cache):
    o = {"engine.device": device, "model.dtype": dtype, "model.num_layers": 2,
         "model.model_dim": 16, "model.num_heads": 2, "model.head_dim": 8,
         "model.num_items": 100, "model.num_actions": 8, "model.max_history": 80,
         "model.max_candidates": 8, "model.init_seed": 3}
    o.update({f"cache.{k}": v for k, v in cache.items()})
    o.update({f"model.{k}": v for k, v in (model or {}).items()})
    return load_spec("rank-small", o)


def runners(device="cpu", dtype="float32", model=None, **cache) -> dict:
    """One engine per mode (not started: tests call the runner directly, no event loop)."""
    return {mode: Engine(tiny_spec(device, dtype, model, mode=mode, **cache)) for mode in MODES}


# Sizes the CUDA attention kernel takes (head dim 32), for the GPU tests.
GPU_MODEL = {"num_layers": 4, "model_dim": 64, "num_heads": 2, "head_dim": 32}


def run_batch(engine: Engine, reqs: list[RankRequest]):
    prepared = [prepare_rank(r, engine.runner.model.cfg) for r in reqs]
    outcome = engine.runner.run(prepared)
    engine.runner.background()
    if hasattr(engine.runner, "flush"):  # offloads finish before the next batch, deterministically
        engine.runner.flush()
    return outcome.results


def req(user, items, actions, cands) -> RankRequest:
    return RankRequest(user_id=user, items=[int(x) for x in items],
                       actions=[int(x) for x in actions], candidates=[int(x) for x in cands])
