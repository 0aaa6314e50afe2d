"""Checkpoint directories: ``config.json`` (the architecture) + ``model.safetensors`` (weights).

Loading checks every tensor's name and shape against the model built from ``config.json`` and
names the first mismatch. No pickle anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON: {err}") from None


def decode_config(raw: dict, cls: type, source: str):
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as err:
        raise CheckpointError(f"{source}: {err}") from None


def load_weights(model: nn.Module, directory: str | Path) -> nn.Module:
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{path}: unreadable: {err}") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: missing tensor `{missing[0]}`"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor `{extra[0]}`")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: tensor `{name}` has shape {tuple(got.shape)}, "
                                  f"config.json implies {tuple(want.shape)}")
    model.load_state_dict(tensors)
    return model


def save_checkpoint(model: nn.Module, config: msgspec.Struct, directory: str | Path) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(msgspec.to_builtins(config), indent=2) + "\n")
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    return out


def hf_state_dict(tensors: dict, cfg) -> dict:
    """A Hugging Face T5 checkpoint's tensors under ``models.t5``'s names (tied embeddings may be
    saved as ``shared``, ``encoder.embed_tokens`` or ``decoder.embed_tokens``)."""
    out = dict(tensors)
    if "shared.weight" not in out:
        for alt in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            if alt in out:
                out["shared.weight"] = out[alt]
                break
    for alt in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        out.pop(alt, None)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
