"""A SID generator's deployment from a spec: the T5 model (checkpoint or random), its catalog
and trie, and the deployment contract both are checked against. (The runtime owns
deployments; models only define modules and load weights.)"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError, ContractError
from ..models.checkpoint import WEIGHTS_FILE, decode_config, read_config
from ..models.t5 import T5, T5Config, hf_state_dict
from ..selection.vocabulary import SidTrie, check_catalog, load_catalog, random_catalog
from .contract import build_contract, check


def t5_config_from_spec(spec) -> T5Config:
    m, cat = spec.generate_model, spec.catalog
    vocab = m.vocab_size or cat.token_offset + sum(cat.codebook_sizes)
    return T5Config(vocab_size=vocab, d_model=m.model_dim, d_kv=m.head_dim, d_ff=m.d_ff,
                    num_layers=m.num_layers, num_decoder_layers=m.num_decoder_layers,
                    num_heads=m.num_heads, feed_forward_proj=m.feed_forward_proj,
                    tie_word_embeddings=m.tie_word_embeddings)


def build_catalog(spec):
    cat = spec.catalog
    if cat.path is not None:
        return load_catalog(cat.path, cat.codebook_sizes)
    return random_catalog(cat.random_items, cat.codebook_sizes, cat.random_seed)


def build_generator(spec, device: torch.device, dtype: torch.dtype, model=None, catalog=None,
                    trie=None):
    """(model, source, trie, contract, catalog) of the spec's generate model, contract-checked.
    A loaded ``model`` (same architecture), a ``catalog`` and its ``trie`` are reused if given
    (a live update that changes the catalog or the policy only reloads nothing else)."""
    m = spec.generate_model
    if catalog is None:
        catalog = build_catalog(spec)
    else:
        check_catalog(catalog, spec.catalog.codebook_sizes)
    if trie is None:
        trie = SidTrie(catalog, spec.catalog.codebook_sizes, spec.catalog.token_offset)
    dname = str(dtype).replace("torch.", "")
    if model is not None:
        contract = build_contract(model.cfg, spec, dname)
        check(contract, {k: t.shape for k, t in model.state_dict().items()}, trie)
        return model, "reused", trie, contract, catalog
    if m.checkpoint is not None:
        raw = read_config(m.checkpoint)
        if raw.get("model_type", "t5") != "t5" and raw.get("family") != "t5":
            raise CheckpointError(f"{m.checkpoint}: model_type {raw.get('model_type')!r}, not t5")
        known = {k: v for k, v in raw.items() if k in T5Config.__struct_fields__}
        cfg = decode_config(known, T5Config, f"{m.checkpoint}/config.json")
        contract = build_contract(cfg, spec, dname)
        path = Path(m.checkpoint) / WEIGHTS_FILE
        if not path.is_file():
            raise CheckpointError(f"{m.checkpoint}: no {WEIGHTS_FILE}")
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors = hf_state_dict(tensors, cfg)
        check(contract, {k: t.shape for k, t in tensors.items()}, trie)
        model = T5.uninitialized(cfg)  # every parameter comes from the strict load below
        extra = sorted(set(tensors) - set(model.state_dict()))
        if extra:
            raise ContractError(f"weights.{extra[0]}: not bound by the contract")
        model.load_state_dict(tensors)
        source = f"ckpt:{m.checkpoint}"
    else:
        cfg = t5_config_from_spec(spec)
        contract = build_contract(cfg, spec, dname)
        model = T5.uninitialized(cfg).init_random(int(m.init_seed))
        check(contract, {k: t.shape for k, t in model.state_dict().items()}, trie)
        source = f"seed:{m.init_seed}"
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    if device.type == "cuda":
        model.align_head()
    return model, source, trie, contract, catalog
