"""A SID generator's deployment from a spec: the T5 model (checkpoint or random), its catalog
and trie, and the deployment contract both are checked against. (The runtime owns
deployments; models only define modules and load weights.)"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, ContractError
from ..models.checkpoint import (WEIGHTS_FILE, check_finite, decode_config, device_copies,
                                 hf_state_dict, read_config, read_safetensors, uninitialized)
from ..models.t5 import T5, T5Config
from ..models.t5_fuse import fuse_projections
from ..selection.vocabulary import SidTrie
from ..selection.catalog import check_catalog, load_catalog, random_catalog
from .contract import build_contract, check, same_architecture


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


def read_checkpoint(directory, spec, dname: str, trie, staging=None):
    """(config, contract, tensors under this module's names, their host buffer) of a
    checkpoint directory, held to the contract (every bound tensor with its shape, nothing
    unbound) and to ``trie``; the tensors are views of one host buffer (``staging``'s: see
    ``models.checkpoint.read_safetensors``)."""
    raw = read_config(directory)
    if raw.get("model_type", "t5") != "t5" and raw.get("family") != "t5":
        raise CheckpointError(f"{directory}: model_type {raw.get('model_type')!r}, not t5")
    known = {k: v for k, v in raw.items() if k in T5Config.__struct_fields__}
    cfg = decode_config(known, T5Config, f"{directory}/config.json")
    contract = build_contract(cfg, spec, dname)
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}")
    tensors, buf = read_safetensors(path, staging)
    tensors = hf_state_dict(tensors, cfg)
    check(contract, {k: t.shape for k, t in tensors.items()}, trie)
    extra = sorted(set(tensors) - set(contract["weights"]))
    if extra:
        raise ContractError(f"weights.{extra[0]}: not bound by the contract")
    return cfg, contract, tensors, buf


def refit_tensors(spec, device: torch.device, dtype: torch.dtype, into, trie, on_read=None,
                  staging=None):
    """(tensors, source, contract) of the spec's checkpoint for a refit into the model
    ``into``: each tensor moved to ``device`` in the dtype of ``into``'s, and nothing else. No
    model is built (constructing a T5, loading its state dict and converting it cost a refit
    ~0.26 s of host time on the CPU machine, beside serving, against ~0.1 s for this).
    ``on_read()``: called once the checkpoint is read and checked, before the moves. The
    checkpoint crosses as one copy of its bytes (``models.checkpoint.device_copies``; from
    ``staging``'s pinned buffer, asynchronously) instead of ~200 pageable per-tensor copies."""
    directory = spec.generate_model.checkpoint
    cfg, contract, tensors, buf = read_checkpoint(directory, spec,
                                                  str(dtype).replace("torch.", ""), trie, staging)
    same_architecture(cfg, into.cfg)
    if on_read is not None:
        on_read()
    dtypes = {k: t.dtype for k, t in into.state_dict().items()}
    moved = device_copies(tensors, buf, device, dtypes, staging)
    check_finite(moved, directory)
    return moved, f"ckpt:{directory}", contract


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
        cfg, contract, tensors, _ = read_checkpoint(m.checkpoint, spec, dname, trie)
        check_finite(tensors, m.checkpoint)  # (on the host: the model moves after the load)
        model = uninitialized(T5, cfg)  # every parameter comes from the strict load below
        model.load_state_dict(tensors)
        source = f"ckpt:{m.checkpoint}"
    else:
        cfg = t5_config_from_spec(spec)
        contract = build_contract(cfg, spec, dname)
        model = uninitialized(T5, cfg).init_random(int(m.init_seed))
        check(contract, {k: t.shape for k, t in model.state_dict().items()}, trie)
        source = f"seed:{m.init_seed}"
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    if device.type == "cuda":
        model.align_head()
        fuse_projections(model)  # (after the last move: a move copies each parameter alone)
    return model, source, trie, contract, catalog
