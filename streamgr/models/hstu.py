"""HSTU ranker in its cache-safe inference form (ARCHITECTURE.md, MTServe section 2).

Tokens are a user's history as interleaved (item, action) pairs, then the candidates. Each token
is its embedding plus a learned absolute position counted forward from the first event, so a
cached token keeps its position as history grows; every candidate sits at position ``2P`` (the
next free one). Each layer::

    x' = LN(x);  u, v, q, k = split(SiLU(x' W_uvqk + b))
    A  = SiLU(alpha q k^T) / N          (N fixed: the configured maximum sequence length)
    y  = x + W_o(LN(A v) * u)

causal over history; each candidate sees all history and itself only. A candidate's score is a
linear head over its final normalised hidden state. Candidate K/V are never cached.

Checkpoint tensor names (``model.safetensors``; ``nn.Linear`` weights are ``[out, in]``)::

    item_embedding.weight      [num_items, model_dim]
    action_embedding.weight    [num_actions, model_dim]
    position_embedding.weight  [2 * max_history + 1, model_dim]
    layers.{i}.input_norm.{weight,bias}   [model_dim]
    layers.{i}.uvqk.{weight,bias}         [4 * heads * head_dim, model_dim], [4 * heads * head_dim]
                                          (row blocks in the order u, v, q, k)
    layers.{i}.attn_norm.{weight,bias}    [heads * head_dim]
    layers.{i}.output.{weight,bias}       [model_dim, heads * head_dim], [model_dim]
    final_norm.{weight,bias}              [model_dim]
    head.{weight,bias}                    [1, model_dim], [1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import hstu_glue
from ..kernels.hstu_attention import JaggedKV, hstu_attention_jagged

NORM_EPS = 1e-6


class HSTUConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Architecture of an HSTU ranker: the content of a checkpoint's ``config.json``."""

    family: str = "hstu"
    num_layers: int
    model_dim: int
    num_heads: int
    head_dim: int
    num_items: int
    num_actions: int
    max_history: int
    max_candidates: int

    @property
    def max_positions(self) -> int:
        return 2 * self.max_history + 1

    @property
    def attn_max_len(self) -> int:
        """N of ``SiLU(alpha q k^T) / N``: the longest sequence a query can attend over."""
        return 2 * self.max_history + self.max_candidates

    @property
    def alpha(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def is_last(self, layer: int) -> bool:
        """The last layer: only its candidates' rows are read (see ``Attention``)."""
        return layer == self.num_layers - 1


@dataclass
class JaggedBatch:
    """One batch of users as jagged token rows (see ``kernels.hstu_attention`` for the layout).

    Device tensors: ``token_ids``, ``is_action``, ``positions``, ``candidate_rows``.
    Host lists (no device syncs in the layer loop): ``q_offsets``, ``num_candidates``,
    ``hist_lens`` (whole-history tokens per user, cached + new).
    """

    token_ids: torch.Tensor
    is_action: torch.Tensor
    positions: torch.Tensor
    candidate_rows: torch.Tensor
    q_offsets: list[int]
    num_candidates: list[int]
    hist_lens: list[int]

    @property
    def new_lens(self) -> list[int]:
        return [self.q_offsets[i + 1] - self.q_offsets[i] - c
                for i, c in enumerate(self.num_candidates)]


# attention(layer, q, k, v) -> [rows, heads, dim]: how a layer's queries meet their keys. The
# default is recompute (the batch's new tokens are each user's whole history); the cache passes
# one that appends new K/V to pages and attends over them. Of the last layer's result only the
# candidates' rows are read, so there an attention may leave the others unwritten
# (``cand_only`` plans skip the row tiles without a candidate: for a recompute, the whole
# causal history attended once more for nothing).
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Projection(NamedTuple):
    """A layer's u, v, q, k (u [T, H*d]; v, q, k [T, H, d], strided views). ``u_raw``: u is
    still before its SiLU (the GPU's fused layer end applies it as it reads u)."""

    u: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    u_raw: bool


class HSTULayer(nn.Module):
    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        inner = cfg.num_heads * cfg.head_dim
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.input_norm = nn.LayerNorm(cfg.model_dim, eps=NORM_EPS)
        self.uvqk = nn.Linear(cfg.model_dim, 4 * inner)
        self.attn_norm = nn.LayerNorm(inner, eps=NORM_EPS)
        self.output = nn.Linear(inner, cfg.model_dim)

    def project(self, x: torch.Tensor) -> Projection:
        """u, v, q, k of tokens ``x`` [T, D]. On the GPU the SiLU pass covers v, q, k only
        (u's SiLU is fused into :meth:`finish`'s kernel)."""
        inner = self.heads * self.head_dim
        uvqk = self.uvqk(hstu_glue.layer_norm(x, self.input_norm))
        # u stays raw where finish's kernel will take it (were it not to, finish's reference
        # applies the SiLU: the choice is only about speed)
        u_raw = hstu_glue.fused_ok(x, None, uvqk[:, :inner], self.attn_norm, self.output)
        if u_raw:
            u, vqk = uvqk[:, :inner], hstu_glue.silu(uvqk[:, inner:])
        else:
            uvqk = F.silu(uvqk)
            u, vqk = uvqk[:, :inner], uvqk[:, inner:]
        v, q, k = vqk.split(inner, dim=-1)
        shape = (x.shape[0], self.heads, self.head_dim)
        return Projection(u, v.reshape(shape), q.reshape(shape), k.reshape(shape), u_raw)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor,
               u_raw: bool = False) -> torch.Tensor:
        """``x + output(attn_norm(attn) * u)`` (one kernel and one GEMM on the GPU)."""
        attn = attn.reshape(x.shape[0], self.heads * self.head_dim)
        return hstu_glue.finish(x, attn, u, self.attn_norm, self.output, u_raw)


class HSTU(nn.Module):
    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.item_embedding = nn.Embedding(cfg.num_items, cfg.model_dim)
        self.action_embedding = nn.Embedding(cfg.num_actions, cfg.model_dim)
        self.position_embedding = nn.Embedding(cfg.max_positions, cfg.model_dim)
        self.layers = nn.ModuleList(HSTULayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.model_dim, eps=NORM_EPS)
        self.head = nn.Linear(cfg.model_dim, 1)

    def init_random(self, seed: int) -> "HSTU":
        """Deterministic random weights (independent of the device and of torch's global RNG).
        Drawn in place: a temporary per tensor doubled the time of rank-ref's 1M-item table."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                # the same values on every device and dtype: drawn and scaled in fp32 on the CPU
                here = p.device.type == "cpu" and p.dtype == torch.float32
                t = (p if here else torch.empty(p.shape)).normal_(generator=gen)
                if name.endswith("embedding.weight"):
                    t.mul_(0.5)
                elif "norm" in name:
                    t.mul_(0.1).add_(1.0 if name.endswith("weight") else 0.0)
                elif p.dim() == 2:
                    t.div_(math.sqrt(p.shape[1]))
                else:
                    t.mul_(0.02)
                if not here:
                    p.copy_(t)
        return self

    def embed(self, batch: JaggedBatch) -> torch.Tensor:
        return hstu_glue.embed(batch.token_ids, batch.is_action, batch.positions,
                               self.item_embedding, self.action_embedding,
                               self.position_embedding)

    @torch.inference_mode()
    def forward(self, batch: JaggedBatch, attention: Attention | None = None,
                rows: int = 0) -> torch.Tensor:
        """Scores of every candidate in the batch, user by user, ``[sum(num_candidates)]`` fp32.
        ``rows``: run the layers over this many rows (zeros past the batch's, belonging to no
        user: only for an attention that leaves such rows alone, the CUDA kernel's), so that
        the GEMMs meet row counts cuBLAS has seen before (the engine's eager GPU batches)."""
        cfg = self.cfg
        if attention is None:
            desc = JaggedKV.recompute(batch.q_offsets, batch.num_candidates)

            def attention(layer, q, k, v):
                return hstu_attention_jagged(q, k, v, desc, layer, cfg.alpha, cfg.attn_max_len,
                                             cand_only=cfg.is_last(layer))
        x = self.embed(batch)
        if rows > x.shape[0]:
            x = F.pad(x, (0, 0, 0, rows - x.shape[0]))
        return self.score(self.run_layers(x, batch, attention, 0, len(self.layers)))

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, batch: JaggedBatch, attention: Attention, start: int,
                   stop: int) -> torch.Tensor:
        """Layers ``start .. stop - 1`` over ``x`` (``forward``'s loop; a rank plan captures
        its first layers and the rest as two graphs)."""
        for l in range(start, stop):
            layer = self.layers[l]
            p = layer.project(x)
            a, u = attention(l, p.q, p.k, p.v), p.u
            if self.cfg.is_last(l):  # from here on only the candidates' rows are read
                c = batch.candidate_rows
                x, a, u = x.index_select(0, c), a.index_select(0, c), u.index_select(0, c)
            x = layer.finish(x, a, u, p.u_raw)
        return x

    @torch.inference_mode()
    def score(self, x: torch.Tensor) -> torch.Tensor:
        """The candidates' scores from the last layer's output (their rows)."""
        return self.head(hstu_glue.layer_norm(x, self.final_norm)).squeeze(-1).float()
