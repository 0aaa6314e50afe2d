"""Small random SID generators: a catalog, a Hugging Face T5 checkpoint, and a spec for both."""

from __future__ import annotations

import numpy as np
import torch

from streamgr.config import load_spec
from streamgr.selection.catalog import random_catalog, save_catalog

CODEBOOKS = [6, 5, 4]
OFFSET = 3


def write_hf_checkpoint(tmp_path, ff="relu", tie=True, seed=0, vocab=None, n_items=60,
                        distinct=False, overrides=None):
    """A random T5 saved by Hugging Face itself, and a catalog; returns (spec, hf model, catalog).
    The spec serves it on the CPU in fp32 unless ``overrides`` say otherwise."""
    from transformers import T5Config, T5ForConditionalGeneration
    vocab = vocab or OFFSET + sum(CODEBOOKS)
    cfg = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                   num_decoder_layers=2, num_heads=4, feed_forward_proj=ff,
                   tie_word_embeddings=tie, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1)
    torch.manual_seed(seed)
    hf = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF's init leaves the output nearly flat: spread it out
        for p in hf.parameters():
            p.mul_(3.0 if p.dim() == 2 else 1.0)
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(ckpt, safe_serialization=True)
    cat = random_catalog(n_items, CODEBOOKS, seed, distinct=distinct)
    save_catalog(cat, tmp_path / "catalog.csv")
    spec = load_spec("gen-small", {
        "engine.device": "cpu", "model.dtype": "float32", "model.init_seed": None,
        "model.checkpoint": str(ckpt), "catalog.path": str(tmp_path / "catalog.csv"),
        "catalog.random_items": 0, "catalog.codebook_sizes": CODEBOOKS,
        "catalog.token_offset": OFFSET, "policy.beam_widths": [8, 8, 8], **(overrides or {})})
    return spec, hf, cat


def context(rng, cat, n):
    """Encoder tokens of n random catalog items, then EOS."""
    rows = rng.integers(len(cat.item_ids), size=n)
    offs = np.cumsum([OFFSET] + CODEBOOKS[:-1])
    return cat.item_ids[rows].tolist(), (cat.sids[rows] + offs).reshape(-1).tolist() + [1]
