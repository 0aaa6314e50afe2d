"""Torch modules (HSTU ranker, SID encoder-decoder) and checkpoint loading.

Must not import engine, cache, protocol or server code.
"""

from __future__ import annotations

import torch

from ..config import ModelSpec
from ..errors import CheckpointError, SpecError
from .checkpoint import HostStaging, decode_config, load_weights, read_config, uninitialized
from .hstu import HSTU, HSTUConfig, JaggedBatch

SIZE_KEYS = ("num_layers", "model_dim", "num_heads", "head_dim", "num_items", "num_actions",
             "max_history", "max_candidates")


def hstu_config_from_spec(spec: ModelSpec) -> HSTUConfig:
    return HSTUConfig(**{k: getattr(spec, k) for k in SIZE_KEYS})


def build_ranker(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 staging: HostStaging | None = None) -> tuple[HSTU, str]:
    """The HSTU of a spec on ``device`` in ``dtype``, and a version string of its weights.

    With ``checkpoint``, ``config.json`` fixes the architecture; the spec's size keys are then
    ignored, and the weights cross to the device as one copy (from ``staging``'s buffer) into a
    model never initialized. With ``init_seed``, the spec's sizes and a deterministic random
    init (on the CPU, the same on every device) are used. Default nn inits are never run
    (``checkpoint.uninitialized``).
    """
    if spec.checkpoint is not None:
        raw = read_config(spec.checkpoint)
        if "model_type" in raw:  # a Hugging Face config: a generate (T5) checkpoint
            raise CheckpointError(f"{spec.checkpoint}: a {raw['model_type']!r} checkpoint "
                                  f"(model_type), not an HSTU ranker's")
        cfg = decode_config(raw, HSTUConfig, f"{spec.checkpoint}/config.json")
        if cfg.family != "hstu":
            raise SpecError(f"model.checkpoint: family `{cfg.family}`, spec says `hstu`")
        model = load_weights(uninitialized(HSTU, cfg, None), spec.checkpoint, device, dtype,
                             staging)
        version = f"ckpt:{spec.checkpoint}"
    else:
        cfg = hstu_config_from_spec(spec)
        model = uninitialized(HSTU, cfg).init_random(int(spec.init_seed))
        version = f"seed:{spec.init_seed}"
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return model, version


__all__ = ["HSTU", "HSTUConfig", "JaggedBatch", "build_ranker", "hstu_config_from_spec"]
