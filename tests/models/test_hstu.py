"""The HSTU model on a jagged batch against a plain per-user dense model written here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from streamgr.cache.history import interleave
from streamgr.engine.rank import UserSlice, build_jagged
from streamgr.errors import CheckpointError
from streamgr.models import HSTU, HSTUConfig
from streamgr.models.checkpoint import save_checkpoint, load_weights

CFG = HSTUConfig(num_layers=2, model_dim=32, num_heads=2, head_dim=16, num_items=500,
                 num_actions=8, max_history=300, max_candidates=16)


def plain_scores(model: HSTU, items, actions, cands) -> torch.Tensor:
    """The whole model for one user, dense, float64, mask written out token by token."""
    cfg = model.cfg
    m = model.double()
    P, C = len(items), len(cands)
    tok = []
    for i, a in zip(items, actions):
        tok += [m.item_embedding.weight[i], m.action_embedding.weight[a]]
    tok += [m.item_embedding.weight[c] for c in cands]
    x = torch.stack(tok)
    pos = list(range(2 * P)) + [2 * P] * C
    x = x + m.position_embedding.weight[pos]
    T = 2 * P + C
    mask = torch.zeros(T, T)
    for i in range(2 * P):
        mask[i, : i + 1] = 1
    for c in range(C):
        mask[2 * P + c, : 2 * P] = 1
        mask[2 * P + c, 2 * P + c] = 1
    H, d = cfg.num_heads, cfg.head_dim
    for layer in m.layers:
        h = F.layer_norm(x, (cfg.model_dim,), layer.input_norm.weight, layer.input_norm.bias, 1e-6)
        u, v, q, k = F.silu(h @ layer.uvqk.weight.T + layer.uvqk.bias).split(H * d, dim=-1)
        q, k, v = (t.reshape(T, H, d).transpose(0, 1) for t in (q, k, v))
        a = F.silu(cfg.alpha * q @ k.transpose(1, 2)) * mask / cfg.attn_max_len
        o = (a @ v).transpose(0, 1).reshape(T, H * d)
        o = F.layer_norm(o, (H * d,), layer.attn_norm.weight, layer.attn_norm.bias, 1e-6)
        x = x + (o * u) @ layer.output.weight.T + layer.output.bias
    y = F.layer_norm(x[2 * P:], (cfg.model_dim,), m.final_norm.weight, m.final_norm.bias, 1e-6)
    out = (y @ m.head.weight.T + m.head.bias).squeeze(-1)
    model.float()
    return out


def random_users(rng, n, lens):
    users = []
    for L in lens:
        users.append((rng.integers(CFG.num_items, size=L), rng.integers(CFG.num_actions, size=L),
                      rng.choice(CFG.num_items, size=int(rng.integers(1, 9)), replace=False)))
    return users


def model_scores(model, users):
    slices = [UserSlice(interleave(i, a), 0, c) for i, a, c in users]
    return model(build_jagged(slices, torch.device("cpu")))


def test_jagged_batch_equals_plain_per_user():
    rng = np.random.default_rng(0)
    model = HSTU(CFG).init_random(1).eval()
    users = random_users(rng, 5, [1, 3, 50, 299, 120])
    got = model_scores(model, users)
    o = 0
    for items, actions, cands in users:
        ref = plain_scores(model, items, actions, cands)
        torch.testing.assert_close(got[o:o + len(cands)].double(), ref, rtol=1e-4, atol=1e-4)
        o += len(cands)


def test_empty_history_user():
    model = HSTU(CFG).init_random(2).eval()
    users = [(np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([3, 4, 5]))]
    got = model_scores(model, users)
    torch.testing.assert_close(got.double(), plain_scores(model, [], [], [3, 4, 5]),
                               rtol=1e-4, atol=1e-4)


def test_candidate_isolation():
    """Changing one candidate changes no other candidate's score."""
    rng = np.random.default_rng(5)
    model = HSTU(CFG).init_random(3).eval()
    items, actions = rng.integers(500, size=40), rng.integers(8, size=40)
    cands = np.array([10, 20, 30, 40, 50])
    base = model_scores(model, [(items, actions, cands)])
    cands2 = cands.copy()
    cands2[2] = 99
    other = model_scores(model, [(items, actions, cands2)])
    diff = (other - base).abs() > 1e-6
    assert diff.tolist() == [False, False, True, False, False]


def test_history_matters():
    """A check that the scores depend on the history at all (guards a vacuous isolation test)."""
    rng = np.random.default_rng(6)
    model = HSTU(CFG).init_random(3).eval()
    cands = np.array([1, 2, 3])
    a = model_scores(model, [(rng.integers(500, size=30), rng.integers(8, size=30), cands)])
    b = model_scores(model, [(rng.integers(500, size=30), rng.integers(8, size=30), cands)])
    assert (a - b).abs().max() > 1e-3


def test_checkpoint_roundtrip_and_errors(tmp_path):
    model = HSTU(CFG).init_random(4)
    save_checkpoint(model, CFG, tmp_path / "m")
    fresh = HSTU(CFG)
    load_weights(fresh, tmp_path / "m")
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    # A config that disagrees with the weights names the tensor.
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    bigger = HSTU(HSTUConfig(**{**cfg, "model_dim": 48}))
    with pytest.raises(CheckpointError, match="item_embedding.weight"):
        load_weights(bigger, tmp_path / "m")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_weights(fresh, tmp_path)


def test_build_ranker_from_checkpoint_never_aliases_the_refit_buffer(tmp_path):
    """A checkpoint read into the engine's reused staging buffer becomes the model's own
    tensors: a later read into that buffer leaves the first model's weights as they were."""
    from streamgr.config import ModelSpec
    from streamgr.models import build_ranker
    from streamgr.models.checkpoint import HostStaging
    sizes = {k: getattr(CFG, k) for k in ("num_layers", "model_dim", "num_heads", "head_dim",
                                          "num_items", "num_actions", "max_history",
                                          "max_candidates")}
    for seed in (4, 5):
        save_checkpoint(HSTU(CFG).init_random(seed), CFG, tmp_path / f"m{seed}")
    staging = HostStaging(pin=False)
    dev = torch.device("cpu")
    a, va = build_ranker(ModelSpec(checkpoint=str(tmp_path / "m4"), init_seed=None, **sizes),
                         dev, torch.bfloat16, staging)
    b, _ = build_ranker(ModelSpec(checkpoint=str(tmp_path / "m5"), init_seed=None, **sizes),
                        dev, torch.bfloat16, staging)
    seeded, vs = build_ranker(ModelSpec(init_seed=4, **sizes), dev, torch.bfloat16)
    assert va.startswith("ckpt:") and vs == "seed:4"
    for (name, p), q, r in zip(a.state_dict().items(), seeded.state_dict().values(),
                               b.state_dict().values()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
        assert not torch.equal(p, r), name
    # a truncated file is a CheckpointError naming where it ends
    f = tmp_path / "m5" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        build_ranker(ModelSpec(checkpoint=str(tmp_path / "m5"), init_seed=None, **sizes), dev,
                     torch.bfloat16, staging)


@pytest.mark.parametrize("extra", [1, 37, 256])
def test_padding_rows_leave_every_score_unchanged(extra):
    """``forward(rows=)``: the layers over more rows than the batch holds (what the engine's
    eager GPU batches do, for cuBLAS's sake) give the same scores bit for bit, even when the
    attention leaves NaN in the padding rows (the CUDA kernel leaves them unwritten): every op
    but the attention is row-local, and the attention here reads the real rows only."""
    from streamgr.kernels.hstu_attention import JaggedKV, hstu_attention_jagged
    torch.manual_seed(0)
    model = HSTU(CFG).init_random(4).eval()
    rng = np.random.default_rng(extra)
    users = [UserSlice(interleave(i, a), 0, c) for i, a, c in random_users(rng, 3, [5, 40, 17])]
    batch = build_jagged(users, torch.device("cpu"))
    n = len(batch.token_ids)
    desc = JaggedKV.recompute(batch.q_offsets, batch.num_candidates)
    seen = []

    def attention(layer, q, k, v):
        seen.append(q.shape[0])
        a = hstu_attention_jagged(q[:n], k[:n], v[:n], desc, layer, CFG.alpha, CFG.attn_max_len)
        return torch.cat([a, torch.full((q.shape[0] - n, *a.shape[1:]), float("nan"))])
    want = model(batch)
    got = model(batch, attention, rows=n + extra)
    assert seen == [n + extra] * CFG.num_layers
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_eager_rows_are_bucketed_only_where_the_kernel_leaves_padding_alone(monkeypatch):
    """The engine's eager batches pad their rows to rank plans' buckets on the attention
    kernel's path only (the reference attends over every row it is given)."""
    from streamgr.engine import rank
    from streamgr.engine.rank_plans import row_bucket
    from tests.cache.helpers import runners
    runner = runners()["recompute"].runner
    assert runner._eager_rows(1000) == 1000  # the CPU: the reference
    monkeypatch.setattr(rank, "kernel_runs", lambda *a: True)
    assert [runner._eager_rows(n) for n in (1, 256, 257, 4097, 30001)] == [
        row_bucket(n) for n in (1, 256, 257, 4097, 30001)] == [256, 256, 512, 5120, 30720]
    runner.pad_eager_rows = False
    assert runner._eager_rows(257) == 257
