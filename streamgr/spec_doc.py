"""Specs rendered: ``docs/specs.md``, every spec key with its type, default and meaning,
generated from the spec structs of ``streamgr.config`` (``streamgr spec-doc`` prints it; a
test keeps the file in sync and fails on a key without a meaning here), and a spec back to
TOML (``spec_to_toml``: ``streamgr init-model`` writes one beside a model)."""

from __future__ import annotations

from typing import Any

import msgspec

from .config import CacheSpec, CatalogSpec, EngineSpec, ModelSpec, PolicySpec, Spec

MEANING = {
    "name": "a label for logs, stats and results",
    "model.family": "`hstu` (the ranker) or `t5` (the SID generator)",
    "model.checkpoint": "a directory with `config.json` + `model.safetensors` (relative to the "
                        "spec file); excludes `init_seed`",
    "model.init_seed": "random weights of the sizes below, from this seed; excludes "
                       "`checkpoint`",
    "model.dtype": "`auto` (bfloat16 on CUDA, float32 on the CPU), `float32`, `bfloat16`, "
                   "`float16`",
    "model.num_layers": "HSTU layers (T5: encoder layers)",
    "model.model_dim": "hidden size",
    "model.num_heads": "attention heads",
    "model.head_dim": "per-head size (T5: `d_kv`)",
    "model.num_items": "item embedding rows: item ids must be below it",
    "model.num_actions": "action embedding rows: action ids must be below it",
    "model.max_history": "most events (item, action) of one user's history",
    "model.max_candidates": "most candidates of one rank request",
    "model.num_decoder_layers": "T5 decoder layers (default: `num_layers`)",
    "model.d_ff": "T5 feed-forward size",
    "model.feed_forward_proj": "T5 feed-forward: `relu` or `gated-gelu`",
    "model.tie_word_embeddings": "T5: the head shares the embedding (and scales by "
                                 "`model_dim ** -0.5`)",
    "model.vocab_size": "T5 vocabulary (default: `token_offset + sum(codebook_sizes)`)",
    "engine.device": "`auto` (CUDA when there is one), `cpu`, `cuda`",
    "engine.max_batch": "requests per batch",
    "engine.max_wait_ms": "how long a batch waits to fill (finite, >= 0)",
    "engine.max_queue": "requests admitted and not finished; past it `Overloaded`",
    "engine.history_events": "events of user histories kept for delta requests (LRU; each "
                             "user also costs 32 events, a buffer's spare room counts; "
                             "~16-20 bytes an event)",
    "engine.decode_plans": "generate on CUDA: batch shapes captured as CUDA graphs (LRU); 0: "
                           "eager",
    "engine.rank_plans": "rank on CUDA: batch shapes whose forward is captured as CUDA graphs "
                         "(LRU); 0: eager",
    "engine.rank_in_flight": "rank batches between submit and answer (1..4): 2 prepares the "
                             "next batch while one computes (a user in flight waits)",
    "engine.gen_in_flight": "generate batches between submit and answer (1..4): 2 packs and "
                            "queues the next batch while one runs on the device",
    "engine.gc_freeze": "freeze the objects alive at start out of the garbage collector's "
                        "reach (full collections stalled serving 57-155 ms)",
    "engine.gc_gen0": "with gc_freeze: allocations between young-generation collections while "
                      "serving (Python's default 700; answers allocate ~24,000 lists per gen-ref "
                      "batch); 0 keeps the interpreter's",
    "engine.switch_interval_ms": "the interpreter's thread switch interval while serving, ms "
                                 "(0 keeps Python's 5 ms): how long a thread waits for the "
                                 "GIL back from another running Python",
    "engine.refit_spare": "generate: build a spare version (weights copy, own decode plans) at "
                          "start, so the first weights refit is written in place too, and warm "
                          "the build thread with three throwaway catalog removals",
    "engine.stall_timeout_s": "seconds a batch may take to finish (its device work, then its "
                              "answers) before the engine is declared dead (`EngineDead`): "
                              "a hung kernel fails requests instead of holding them; 0: no "
                              "limit",
    "cache.mode": "`recompute` (no cache), `gpu-only` (device pages), `hierarchical` (device "
                  "pages + host chunks)",
    "cache.page_tokens": "tokens per device page",
    "cache.chunk_tokens": "tokens per host chunk (a multiple of `page_tokens`)",
    "cache.device_pages": "pages of the device store (checked against the device's free "
                          "memory at start)",
    "cache.host_chunks": "chunks of the host store (checked against available RAM at start)",
    "cache.offload_quota_tokens": "tokens queued for offload at once (>= `chunk_tokens`); "
                                  "beyond it offloads are deferred, never lost",
    "cache.host_pinned": "page-lock the whole host store (GPU): onload DMAs straight from it",
    "cache.host_huge_pages": "back the host store with transparent huge pages (Linux): faster to page-lock",
    "cache.onload_split": "host hits (hierarchical): the share of a user's held K/V onloaded, in "
                          "whole chunks, the rest recomputed while it moves; 1 onloads all, "
                          "`auto` chooses per batch by onload and recompute costs measured at "
                          "start and corrected from each host-hit batch's device timings (the "
                          "longest users onloaded first)",
    "catalog.path": "CSV `item_id,s1,s2,...` or `.npy` [items, 1 + depth] of integers; "
                    "each item id once (one SID an item; items may share a SID); excludes "
                    "`random_items`",
    "catalog.random_items": "without a path: this many items with random distinct SIDs",
    "catalog.random_seed": "seed of the random catalog",
    "catalog.codebook_sizes": "codes per SID level (one entry per level)",
    "catalog.token_offset": "model token of level 0 code 0 (after pad 0, eos 1, unk 2)",
    "catalog.sid_policy": "items sharing one SID: `all` of them, or the `first`",
    "policy.beam_widths": "beams kept after each step (one per SID level)",
    "policy.top_k": "items returned by default",
    "policy.max_top_k": "the largest `top_k` a request may ask for",
    "policy.max_context_items": "history items the encoder reads (the newest)",
    "policy.append_eos": "end the encoder input with EOS",
    "policy.max_per_prefix": "diversity: answered items per first SID code (0: no cap); a "
                             "request's `max_per_prefix` overrides it",
    "generator": "a `[generator]` section (a `t5` model) beside an HSTU `[model]`: the engine "
                 "serves both",
}

SECTIONS = (("", Spec), ("model", ModelSpec), ("engine", EngineSpec), ("cache", CacheSpec),
            ("catalog", CatalogSpec), ("policy", PolicySpec))
STRUCT_FIELDS = {"model", "engine", "cache", "catalog", "policy"}


def _type(t) -> str:
    s = repr(t).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return s.replace("streamgr.config.", "").replace("|", "\\|")  # a bar would end the cell


def _default(f) -> str:
    if f.default is not msgspec.NODEFAULT:
        return f"`{f.default!r}`".replace("'", '"')
    if f.default_factory is not msgspec.NODEFAULT:
        v = f.default_factory()
        return "section defaults" if isinstance(v, msgspec.Struct) else f"`{v!r}`"
    return "required"


def keys() -> list[str]:
    out = []
    for section, cls in SECTIONS:
        for f in msgspec.structs.fields(cls):
            if not section and f.name in STRUCT_FIELDS:
                continue
            out.append(f"{section}.{f.name}" if section else f.name)
    return out


def render() -> str:
    lines = ["# Spec reference", "",
             "Generated from `streamgr/config.py` by `streamgr spec-doc` (a test keeps it in "
             "sync). A spec is a TOML file with these sections; any key can be overridden with "
             "`--set KEY=VALUE` (or a dict of dotted keys from code); `--set KEY=none` removes a "
             "key so it takes its default. Unknown keys, wrong types and sizes the machine "
             "cannot hold are errors that name the key.", ""]
    for section, cls in SECTIONS:
        lines += [f"## {'[' + section + ']' if section else 'top level'}", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in msgspec.structs.fields(cls):
            if not section and f.name in STRUCT_FIELDS:
                continue
            key = f"{section}.{f.name}" if section else f.name
            lines.append(f"| `{key}` | `{_type(f.type)}` | {_default(f)} | {MEANING[key]} |")
        lines.append("")
    return "\n".join(lines)


def spec_to_toml(spec: Spec) -> str:
    """Render a spec back to TOML (used by ``streamgr init-model`` to write a spec beside a model)."""
    lines: list[str] = [f'name = "{spec.name}"']
    for section, obj in msgspec.to_builtins(spec).items():
        if not isinstance(obj, dict):
            continue
        lines.append(f"\n[{section}]")
        for k, v in obj.items():
            if v is None:
                continue
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")
