"""The deployment contract of a generate model: what the runtime may ask of the engine.

Generated from the model config and the spec's policy overlay: per-step shapes and dtypes,
weight bindings (names and shapes) and the step flow. ``check`` holds a checkpoint and the SID
vocabulary to it before anything serves; a mismatch is a ``ContractError`` naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from ..errors import ContractError
from ..models.t5 import T5, T5Config


_BINDINGS: dict[tuple, dict[str, list[int]]] = {}


def weight_bindings(cfg: T5Config) -> dict[str, list[int]]:
    # Once per architecture, from a model on the meta device: shapes only. (Built on the host
    # and then moved, every contract (each live update) drew ~340 MB of random fp32 weights
    # for nothing; on the meta device the module tree still costs ~25 ms of Python.)
    key = msgspec.structs.astuple(cfg)
    if key not in _BINDINGS:
        with torch.device("meta"):
            model = T5(cfg)
        _BINDINGS[key] = {name: list(t.shape) for name, t in model.state_dict().items()}
    return {name: list(shape) for name, shape in _BINDINGS[key].items()}


def same_architecture(new: T5Config, serving: T5Config) -> None:
    """Refuse weights of another architecture, naming the first field that differs (the
    contract binds shapes; this binds the rest, e.g. the activation)."""
    for field in T5Config.__struct_fields__:
        a, b = getattr(new, field), getattr(serving, field)
        if a != b:
            raise ContractError(f"model.{field}: the new weights have {a!r}, the engine serves "
                                f"{b!r}")


def build_contract(cfg: T5Config, spec, dtype: str) -> dict[str, Any]:
    cat, pol = spec.catalog, spec.policy
    depth = len(cat.codebook_sizes)
    L, H, d = cfg.decoder_layers, cfg.num_heads, cfg.d_kv
    steps = []
    prev = 1
    for t, (C, W) in enumerate(zip(cat.codebook_sizes, pol.beam_widths)):
        off = cat.token_offset + sum(cat.codebook_sizes[:t])
        steps.append({
            "step": t,
            "inputs": {"tokens": {"shape": ["R", prev], "dtype": "int64"},
                       "self_kv": {"shape": [L, 2, "R", prev, H, t + 1, d], "dtype": dtype},
                       "cross_kv": {"shape": [L, 2, "R", "S", H, d], "dtype": dtype}},
            "outputs": {"log_probs": {"shape": ["R", prev, C], "dtype": "float32",
                                      "vocab_slice": [off, off + C]},
                        "survivors": {"shape": ["R", W], "dtype": "int64"}},
            "flow": ["decode", "log_softmax(full vocab)", f"mask(trie level {t})",
                     f"topk({W} over beams x {C})"] + (["compact(self K/V)"] if t + 1 < depth else
                                                      ["map SIDs to items"]),
        })
        prev = W
    return {
        "model": {"family": "t5", "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
                  "encoder_layers": cfg.num_layers, "decoder_layers": L, "heads": H, "d_kv": d,
                  "d_ff": cfg.d_ff, "feed_forward_proj": cfg.feed_forward_proj,
                  "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": dtype},
        "vocabulary": {"depth": depth, "codebook_sizes": list(cat.codebook_sizes),
                       "token_offset": cat.token_offset,
                       "vocab_size": cat.token_offset + sum(cat.codebook_sizes),
                       "sid_policy": cat.sid_policy},
        "policy": {"beam_widths": list(pol.beam_widths), "top_k": pol.top_k,
                   "max_context_items": pol.max_context_items, "append_eos": pol.append_eos,
                   "max_batch": spec.engine.max_batch},
        "encoder": {"inputs": {"tokens": {"shape": ["R", "S"], "dtype": "int64",
                                          "max_S": depth * pol.max_context_items + 1}}},
        "steps": steps,
        "weights": weight_bindings(cfg),
    }


def check(contract: dict, tensors: dict[str, Any] | None, trie=None) -> None:
    """Hold a checkpoint's tensors (name -> shape) and the trie to the contract."""
    voc = contract["vocabulary"]
    if contract["model"]["vocab_size"] < voc["vocab_size"]:
        raise ContractError(f"vocabulary.vocab_size: the SID tokens need {voc['vocab_size']} "
                            f"tokens, the model has {contract['model']['vocab_size']}")
    if len(contract["policy"]["beam_widths"]) != voc["depth"]:
        raise ContractError(f"policy.beam_widths: {len(contract['policy']['beam_widths'])} steps "
                            f"for SIDs of depth {voc['depth']}")
    if tensors is not None:
        for name, shape in contract["weights"].items():
            if name not in tensors:
                raise ContractError(f"weights.{name}: missing from the checkpoint")
            got = list(tensors[name])
            if got != shape:
                raise ContractError(f"weights.{name}: shape {got}, the contract binds {shape}")
    if trie is not None:
        if trie.depth != voc["depth"]:
            raise ContractError(f"vocabulary.depth: the catalog's SIDs have {trie.depth} levels, "
                                f"the contract {voc['depth']}")
        if trie.n_items() == 0:
            raise ContractError("vocabulary.items: the catalog is empty")
