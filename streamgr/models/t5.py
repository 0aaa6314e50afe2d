"""A T5-style encoder-decoder that loads Hugging Face T5 checkpoints (TIGER/GRID-style SID models).

Relative position buckets (bidirectional in the encoder, causal in the decoder), RMS layer norm
in fp32, relu or gated-gelu feed-forward, tied (with T5's ``d_model ** -0.5`` rescaling) or
untied head, attention without 1/sqrt(d) scaling. Written from T5's definition, no
``transformers`` import. Tensor names are Hugging Face's (``shared.weight``,
``encoder.block.{i}.layer.0.SelfAttention.q.weight``, ... ``lm_head.weight``).

Decoding is split the way the SID runtime needs it: ``encode`` once per request; ``cross_kv``
once per request (kept at [requests], never copied per beam); ``decode_step`` for all live
beams with their own self K/V, attending the cross K/V of their request by index.
"""

from __future__ import annotations

import math
import os
import warnings

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels.decoder_attention import self_attend
from ..kernels.encoder_bias import encoder_bias
from ..kernels.t5_attention import (CROSS_MIN_ROWS, cross_attention, cross_kernel_applies,
                                     encoder_attention, kernel_applies)
from ..kernels.head_lse import head_log_probs
from ..kernels.rms_norm import rms_norm
from . import t5_fuse


class T5Config(msgspec.Struct, kw_only=True):
    """The fields of a Hugging Face T5 ``config.json`` this model uses (others are ignored)."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_decoder_layers: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    # transformers 5 keeps the head tied and says separately whether the decoder output is
    # rescaled by d_model ** -0.5 before it; older configs imply it from tie_word_embeddings.
    scale_decoder_outputs: bool | None = None
    decoder_start_token_id: int = 0
    pad_token_id: int = 0
    eos_token_id: int = 1

    @property
    def decoder_layers(self) -> int:
        return self.num_decoder_layers if self.num_decoder_layers is not None else self.num_layers

    @property
    def scale_outputs(self) -> bool:
        return self.tie_word_embeddings if self.scale_decoder_outputs is None \
            else self.scale_decoder_outputs

    @property
    def gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated")


def relative_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int,
                    max_distance: int) -> torch.Tensor:
    """T5's bucketing of ``key position - query position``."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    max_exact = num_buckets // 2
    small = rel < max_exact
    large = max_exact + (torch.log(rel.float().clamp(min=1) / max_exact)
                         / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(small, rel, large)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused(x):  # one kernel; fp32 inside, rounded once (kernels/rms_norm.py)
            return rms_norm(x, self.weight, self.eps)
        var = x.float().pow(2).mean(-1, keepdim=True)
        y = x.float() * torch.rsqrt(var + self.eps)
        return (self.weight * y.to(self.weight.dtype)) if self.weight.dtype != torch.float32 \
            else self.weight * y


class Attention(nn.Module):
    def __init__(self, cfg: T5Config, relative_bias: bool) -> None:
        super().__init__()
        inner = cfg.num_heads * cfg.d_kv
        self.h, self.d = cfg.num_heads, cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        if relative_bias:
            self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)

    def heads(self, x: torch.Tensor) -> torch.Tensor:  # [..., T, H*d] -> [..., H, T, d]
        return x.view(*x.shape[:-1], self.h, self.d).transpose(-3, -2)


def fused(x: torch.Tensor) -> bool:
    """Half-precision CUDA activations take the fused kernels (attention, RMS norm); fp32 and
    the CPU keep the step-by-step reference arithmetic."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def bias_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if fused(x) else torch.float32


_fused_attention_ok = True
# cuDNN's fused attention first, the memory-efficient kernel where cuDNN refuses a shape.
# On the H200 cuDNN ran gen-ref's encoder layer and cross-attention in under half the
# memory-efficient kernel's time (tools/bench_t5_attention.py, docs/benchmarks.md). cuDNN
# builds a plan per new shape (milliseconds of CPU): the decode plans capture each shape once,
# and eager mode pays it once per shape. STREAMGR_T5_ATTENTION=efficient keeps the
# memory-efficient kernel only.
_BACKENDS = ([SDPBackend.EFFICIENT_ATTENTION]
             if os.environ.get("STREAMGR_T5_ATTENTION", "cudnn") == "efficient"
             else [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def _backends():
    try:
        return sdpa_kernel(_BACKENDS, set_priority=True)
    except TypeError:  # a torch without set_priority: its own order among these
        return sdpa_kernel(_BACKENDS)


def attend(q, k, v, bias, fuse: bool = True) -> torch.Tensor:
    """softmax(q k^T + bias) v in fp32 softmax, as T5 does (no 1/sqrt(d)). In half precision
    on CUDA (and ``fuse``): one fused attention kernel (``_BACKENDS``), no [.., Q, K] scores in
    memory; the additive bias is then at the activations' precision, as Hugging Face's T5 has it
    in bf16. Never SDPA's math path (fp32 GEMMs): it was its choice for gen-ref's shapes."""
    global _fused_attention_ok
    if fuse and _fused_attention_ok and fused(q):
        try:
            if bias is not None and bias.stride(-1) != 1:
                bias = bias.contiguous()
            with _backends():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        except RuntimeError as e:  # shapes the kernel refuses: the reference below, said once
            _fused_attention_ok = False
            warnings.warn(f"fused attention unavailable, using the reference path: {e}")
    s = torch.matmul(q, k.transpose(-1, -2)).float()
    if bias is not None:
        s = s + bias
    return torch.matmul(F.softmax(s, dim=-1).to(v.dtype), v)


class FeedForward(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        if cfg.gated:
            self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.gated = cfg.gated

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``wo(act(wi(x)))``, plus ``residual`` when given (added in the GEMM, fused path)."""
        if self.gated:  # gated-gelu uses the tanh approximation ("gelu_new")
            h = F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x)
        elif fused(x):  # the ReLU in the GEMM's epilogue (cuBLASLt), not a pass of its own
            zero = self._zero_bias(x)
            h = torch._addmm_activation(zero, x.reshape(-1, x.shape[-1]), self.wi.weight.t())
            h = h.view(*x.shape[:-1], -1)
        else:
            h = F.relu(self.wi(x))
        return self.wo(h) if residual is None else residual_linear(residual, h, self.wo)

    def _zero_bias(self, x: torch.Tensor) -> torch.Tensor:
        """A zero bias of ``d_ff`` for the fused ReLU GEMM (made on first use, outside any
        capture: the decode plans warm up eagerly first)."""
        z = getattr(self, "_zero", None)
        if z is None or z.device != x.device or z.dtype != x.dtype:
            z = self._zero = torch.zeros(self.wi.weight.shape[0], dtype=x.dtype, device=x.device)
        return z


def residual_linear(x: torch.Tensor, inp: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """``x + lin(inp)``. Half precision on CUDA: one GEMM adding ``x`` in its epilogue (beta 1,
    rounded once), written over ``x`` (callers rebind it; out of place ``addmm`` first copies
    ``x``: 32 D2D copies of ~7.6 us a gen-ref batch, session 14). fp32 and the CPU keep the
    two steps (fp32 stays bit-equal to Hugging Face's)."""
    if not fused(x):
        return x + lin(inp)
    inp2, w = inp.reshape(-1, inp.shape[-1]), lin.weight.t()
    if x.is_contiguous():
        return x.view(-1, x.shape[-1]).addmm_(inp2, w).view(x.shape)
    return torch.addmm(x.reshape(-1, x.shape[-1]), inp2, w).view(x.shape)


class _Sub(nn.Module):
    """``layer.{j}`` of a block: an attention or feed-forward with its pre-norm."""

    def __init__(self, cfg: T5Config, inner: nn.Module, name: str) -> None:
        super().__init__()
        setattr(self, name, inner)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


class Block(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool, relative_bias: bool) -> None:
        super().__init__()
        subs = [_Sub(cfg, Attention(cfg, relative_bias), "SelfAttention")]
        if decoder:
            subs.append(_Sub(cfg, Attention(cfg, False), "EncDecAttention"))
        subs.append(_Sub(cfg, FeedForward(cfg), "DenseReluDense"))
        self.layer = nn.ModuleList(subs)


class Stack(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool) -> None:
        super().__init__()
        n = cfg.decoder_layers if decoder else cfg.num_layers
        self.block = nn.ModuleList(Block(cfg, decoder, i == 0) for i in range(n))
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


class T5(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = Stack(cfg, decoder=False)
        self.decoder = Stack(cfg, decoder=True)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def align_head(self, multiple: int = 64) -> "T5":
        """Give the output head a row count that is a multiple of ``multiple``: the head's
        weight becomes the first ``vocab_size`` rows of a zero-padded buffer, and the head GEMM
        runs over the whole buffer (its extra logits are sliced off before the softmax). With
        gen-ref's 24,579 tokens the unaligned GEMM fell to slow sm75 tiles. A view, not a
        copy: weights written in place stay the head's weights."""
        head = self.shared if self.cfg.tie_word_embeddings else self.lm_head
        w = head.weight
        rows = -(-w.shape[0] // multiple) * multiple
        if rows != w.shape[0]:
            buf = torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
            buf[:w.shape[0]].copy_(w.detach())
            head.weight = nn.Parameter(buf[:w.shape[0]], requires_grad=False)
            self._head_rows = buf
        return self

    def head_logits(self, y: torch.Tensor) -> torch.Tensor:
        """Logits [N, >= vocab_size]: the first ``vocab_size`` columns are the vocabulary's (the
        aligned buffer's extra columns, if any, follow; slicing them off here would make the
        log-softmax read a strided matrix)."""
        buf = getattr(self, "_head_rows", None)
        if buf is not None:
            return F.linear(y, buf)
        return F.linear(y, self.shared.weight) if self.cfg.tie_word_embeddings else self.lm_head(y)

    def init_random(self, seed: int) -> "T5":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if "layer_norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif "relative_attention_bias" in name:
                    p.copy_(0.5 * torch.randn(p.shape, generator=gen))
                else:
                    fan = p.shape[1] if p.dim() == 2 and "shared" not in name else self.cfg.d_model
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan))
        return self

    def _bias(self, attn: Attention, q_pos: torch.Tensor, k_pos: torch.Tensor,
              bidirectional: bool) -> torch.Tensor:
        rel = k_pos[None, :] - q_pos[:, None]
        # Contiguous: the fused attention kernel needs the key dimension at stride 1.
        return self._bucket_bias(attn, rel, bidirectional).permute(2, 0, 1).contiguous()  # [H, Q, K]

    def _bucket_bias(self, attn: Attention, rel: torch.Tensor,
                     bidirectional: bool) -> torch.Tensor:
        """The bias of each relative position in ``rel`` (key - query): [..., H] fp32."""
        b = relative_bucket(rel, bidirectional, self.cfg.relative_attention_num_buckets,
                            self.cfg.relative_attention_max_distance)
        return attn.relative_attention_bias(b).float()

    def _encoder_bias(self, attn: Attention, S: int, device) -> torch.Tensor:
        """``_bias`` of positions ``0..S-1`` against themselves as a [H, 2S - 1] fp32 table of
        distances (index ``j - i + S - 1``): the bias depends on ``j - i`` only, so the table
        is looked up for the ``2S - 1`` distances (not an S x S embedding gather);
        ``kernels.encoder_bias`` spreads it over [R, H, S, S] with the mask."""
        return self._bucket_bias(attn, torch.arange(-(S - 1), S, device=device), True).t()

    @torch.inference_mode()
    def encode(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``tokens`` [R, S] (right-padded), ``mask`` [R, S] True on real tokens -> [R, S, D]."""
        x = self.shared(tokens)
        R, S = tokens.shape
        H, d = self.cfg.num_heads, self.cfg.d_kv
        first = self.encoder.block[0].layer[0].SelfAttention
        table = self._encoder_bias(first, S, tokens.device).contiguous()  # [H, 2S - 1] fp32
        # bf16 CUDA: the bias from the table inside the attention kernel (kernels/t5_attention);
        # else one dense [R, H, S, S] bias for the fused attention (or the reference).
        inner = fused(x) and kernel_applies(x, d, S)
        bias = None if inner else encoder_bias(table, mask, bias_dtype(x))
        for blk in self.encoder.block:
            sa, ff = blk.layer[0], blk.layer[1]
            h = sa.layer_norm(x)
            a = sa.SelfAttention
            if inner:  # q, k, v: one GEMM where the projections are fused (t5_fuse)
                q, k, v = (t.view(R, S, H, d) for t in t5_fuse.qkv(a, h))
                o = encoder_attention(q, k, v, table, mask)
                x = residual_linear(x, o.view(R, S, -1), a.o)
            else:
                o = attend(a.heads(a.q(h)), a.heads(a.k(h)), a.heads(a.v(h)), bias)
                x = residual_linear(x, o.transpose(-3, -2).reshape(R, S, -1), a.o)
            x = ff.DenseReluDense(ff.layer_norm(x), residual=x)
        return self.encoder.final_layer_norm(x)

    @torch.inference_mode()
    def cross_kv(self, enc: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer, the cross-attention K, V of each request: [R, S, H, d] views."""
        return t5_fuse.cross_kv(self, enc)

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, step: int, self_k: torch.Tensor,
                    self_v: torch.Tensor, cross: list, enc_mask: torch.Tensor,
                    beams: int, anc: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder step for ``R * beams`` rows (row = request * beams + beam).

        ``tokens`` [R*beams] this step's input token; ``self_k/v`` [T, layers, >= R*beams, H,
        d] (T > ``step``; each position one contiguous slab, this step's write contiguous) with
        positions ``< step`` filled where earlier steps wrote them: row ``i``'s position ``p``
        at row ``anc[p, i]`` (parent pointers, ``anc`` [>= step, >= R*beams]; None: row ``i``),
        and this step's K/V written at rows ``0..R*beams-1`` of ``step``; ``cross`` per layer
        [R, S, H, d] (``cross_kv``);
        ``enc_mask`` [R, S]. Returns log-probabilities over the full vocabulary
        [R*beams, vocab] (fp32): dense, or for bf16 on CUDA a lazy ``LogProbs`` (per-row
        log-sum-exp; ``gather`` the columns needed).
        """
        cfg = self.cfg
        N = tokens.shape[0]
        R = N // beams
        H, d = cfg.num_heads, cfg.d_kv
        x = self.shared(tokens)[:, None, :]  # [N, 1, D]
        first = self.decoder.block[0].layer[0].SelfAttention
        pos = torch.arange(step + 1, device=tokens.device)
        bt = bias_dtype(x)
        # [step+1, H] fp32, contiguous once here (the kernel wants it so, every layer)
        sbias = self._bias(first, pos[-1:], pos, False)[:, 0].t().contiguous()
        cbias = None  # the additive mask of the cuDNN path, made where it runs
        for li, blk in enumerate(self.decoder.block):
            sa, ca, ff = blk.layer
            h = sa.layer_norm(x)[:, 0]
            a = sa.SelfAttention
            # This step's K/V written into the buffer and attended in one kernel (bf16 CUDA).
            q, k, v = (t.view(N, H, d) for t in t5_fuse.qkv(a, h))
            o = self_attend(q, k, v, self_k[:, li], self_v[:, li], step, sbias, anc)
            x = residual_linear(x, o.reshape(N, 1, -1), a.o)
            h = ca.layer_norm(x)
            c = ca.EncDecAttention
            # A request's beams are the query rows of one [beams, S] product against its own
            # cross K/V [R, S, H, d]: broadcasting K over beams instead would make matmul
            # materialize a per-beam copy (GBs at gen-ref's 256 beams x 769 positions).
            q = c.q(h).view(R, beams, H, d)
            k, v = cross[li]  # [R, S, H, d]
            if beams >= CROSS_MIN_ROWS and cross_kernel_applies(q, k):  # Hopper: wgmma
                o = cross_attention(q, k, v, enc_mask)  # [R, beams, H, d]
            else:  # [R, H, beams, d]
                if cbias is None:
                    cbias = torch.where(enc_mask, 0.0, torch.finfo(bt).min).to(bt)[:, None, None]
                o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           cbias).transpose(1, 2)
            x = residual_linear(x, o.reshape(N, 1, -1), c.o)
            x = ff.DenseReluDense(ff.layer_norm(x), residual=x)
        y = self.decoder.final_layer_norm(x)[:, 0]
        if cfg.scale_outputs:
            y = y * cfg.d_model ** -0.5
        return head_log_probs(self.head_logits(y), cfg.vocab_size)

