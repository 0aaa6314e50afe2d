"""Deployment specs: TOML files decoded into typed ``msgspec.Struct``s.

A spec names the model, the engine's batching and the cache. Unknown keys and wrong types are
errors that name the key (``model.num_layer: unknown key``). Any key can be overridden with a
dotted name, from code (``{"cache.mode": "recompute"}``) or the CLI (``--set cache.mode=recompute``).
Built-in specs (``rank-small``, ``rank-ref``, ...) ship inside the package.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping

import msgspec

from .errors import SpecError

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
CacheMode = Literal["recompute", "gpu-only", "hierarchical"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A spec section: unknown keys are errors."""


class ModelSpec(_Section, kw_only=True):
    family: Literal["hstu", "t5"] = "hstu"
    # Exactly one of checkpoint (config.json + model.safetensors) or init_seed (random weights)
    checkpoint: str | None = None
    init_seed: int | None = None
    dtype: DType = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    num_layers: int = 2
    model_dim: int = 64
    num_heads: int = 2
    head_dim: int = 32
    num_items: int = 1000
    num_actions: int = 16
    max_history: int = 512  # events (item, action) per user
    max_candidates: int = 64
    # T5 (family = "t5") sizes for init_seed models; a checkpoint's config.json fixes them.
    # model_dim, num_layers, num_heads and head_dim (d_kv) above apply too.
    num_decoder_layers: int | None = None
    d_ff: int = 256
    feed_forward_proj: Literal["relu", "gated-gelu"] = "relu"
    tie_word_embeddings: bool = True
    vocab_size: int | None = None  # default: token_offset + sum(codebook_sizes)

    def __post_init__(self) -> None:
        for name in ("num_layers", "model_dim", "num_heads", "head_dim", "num_items",
                     "num_actions", "max_history", "max_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1")
        if self.checkpoint is None and self.init_seed is None:
            raise ValueError("one of `checkpoint` or `init_seed` is required")
        if self.checkpoint is not None and self.init_seed is not None:
            raise ValueError("`checkpoint` and `init_seed` exclude each other")


class EngineSpec(_Section, kw_only=True):
    device: Device = "auto"
    max_batch: int = 8
    max_wait_ms: float = 2.0
    max_queue: int = 4096  # requests admitted but not finished; beyond it: Overloaded
    # Events of user histories kept for delta requests (LRU), as interleaved int64 tokens with
    # up to 25% spare room: ~16-20 bytes an event.
    history_events: int = 20_000_000
    # Generate on CUDA: batch shapes whose whole beam search is captured as a CUDA graph and
    # replayed (runtime/plans.py), kept in an LRU; 0 searches eagerly.
    decode_plans: int = 16
    # Rank on CUDA: batch shapes whose whole forward is captured as two CUDA graphs and replayed
    # (engine/rank_plans.py), kept in an LRU; 0 runs every batch eagerly.
    rank_plans: int = 32
    # Rank (generate) batches between submit and answer: 2 prepares batch n+1 (plan, pack,
    # queue) while batch n computes (rank: a user in a batch in flight waits for a later one).
    # 2 served a rank-ref trace several times faster than 1 on the H200 (docs/benchmarks.md).
    rank_in_flight: int = 2
    gen_in_flight: int = 2
    # At start, move every object alive then out of the collector's reach (gc.freeze): a full
    # collection otherwise walks torch's and the models' objects, 100+ ms of stalled serving.
    gc_freeze: bool = True
    # With gc_freeze: allocations between young-generation collections (Python's default is
    # 700: with a gen-ref answer's ~24,000 lists per batch the collector ran dozens of times a
    # batch; docs/benchmarks.md, session 3). 0 keeps the interpreter's threshold.
    gc_gen0: int = 50_000
    # The thread switch interval while serving (ms; 0 keeps Python's 5 ms). The event loop and
    # the engine's threads share one GIL: a thread that lets it go inside a numpy call may wait
    # a whole interval to get it back (docs/benchmarks.md, session 13).
    switch_interval_ms: float = 0.0
    # Generate: at start, build a spare version (a copy of the weights with its own decode
    # plans) for weights refits to write into, so the first refit is in place too; without it
    # the first refit builds a whole version and captures its plans beside live traffic (the
    # p99 of a refit phase on the H200: docs/benchmarks.md). Costs a second copy of the
    # weights and of the plans' memory. Rank and generate: pins the host buffer checkpoint
    # refits read into at start (CUDA), sized for an fp32 checkpoint.
    refit_spare: bool = False
    # A batch whose finish (the wait for its device work, then its answers) takes longer marks
    # the engine dead (EngineDead to its requests, those queued and every later one) instead of
    # leaving them waiting for ever: a hung kernel never returns the stream (sessions 37-39 hung
    # the H200 so). Seconds; 0: wait for ever. Device batches here take milliseconds.
    stall_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("`max_batch` must be >= 1")
        if not math.isfinite(self.max_wait_ms) or self.max_wait_ms < 0:
            raise ValueError("`max_wait_ms` must be a finite number >= 0")
        if self.max_queue < 1:
            raise ValueError("`max_queue` must be >= 1")
        if self.history_events < 0:
            raise ValueError("`history_events` must be >= 0")
        if self.decode_plans < 0 or self.rank_plans < 0:
            raise ValueError("`decode_plans` and `rank_plans` must be >= 0")
        if self.gc_gen0 < 0:
            raise ValueError("`gc_gen0` must be >= 0")
        if not (math.isfinite(self.switch_interval_ms) and 0 <= self.switch_interval_ms <= 100):
            raise ValueError("`switch_interval_ms` must be a number in 0..100 (0: Python's)")
        if not (1 <= self.rank_in_flight <= 4 and 1 <= self.gen_in_flight <= 4):
            raise ValueError("`rank_in_flight` and `gen_in_flight` must be 1..4")
        if not math.isfinite(self.stall_timeout_s) or self.stall_timeout_s < 0:
            raise ValueError("`stall_timeout_s` must be a finite number >= 0 (0: no limit)")


class CacheSpec(_Section, kw_only=True):
    mode: CacheMode = "recompute"
    page_tokens: int = 32
    chunk_tokens: int = 1024
    device_pages: int = 4096
    host_chunks: int = 65536
    offload_quota_tokens: int = 65536  # tokens queued for offload at once; beyond: deferred
    # (each key's meaning: spec_doc.MEANING, rendered in docs/specs.md)
    host_pinned: bool = False  # page-locked RAM for the whole tier; onload DMAs from it
    host_huge_pages: bool = True  # page-locking is ~2.7x faster at start (benchmarks, s. 7)
    onload_split: float | Literal["auto"] = 1.0  # cache/onload_split.py

    def __post_init__(self) -> None:
        if not isinstance(self.onload_split, str) and not 0 <= self.onload_split <= 1:
            raise ValueError("`onload_split` must be \"auto\" or a number in 0..1")
        for name in ("page_tokens", "chunk_tokens", "device_pages", "host_chunks",
                     "offload_quota_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1")
        if self.chunk_tokens % self.page_tokens:
            raise ValueError("`chunk_tokens` must be a multiple of `page_tokens`")
        if self.mode == "hierarchical" and self.offload_quota_tokens < self.chunk_tokens:
            # an offload moves whole chunks: a smaller quota would never admit one
            raise ValueError(f"`offload_quota_tokens` ({self.offload_quota_tokens}) must be >= "
                             f"`chunk_tokens` ({self.chunk_tokens}), else nothing is offloaded")


class CatalogSpec(_Section, kw_only=True):
    """The SID vocabulary of a generate model."""

    path: str | None = None  # CSV `item_id,s1,s2,...` or .npy [items, 1 + depth]
    random_items: int = 0  # without a path: this many items with random distinct SIDs
    random_seed: int = 0
    codebook_sizes: list[int] = msgspec.field(default_factory=lambda: [16, 16, 16])
    token_offset: int = 3  # model token of level 0 code 0 (after pad 0, eos 1, unk 2)
    sid_policy: Literal["all", "first"] = "all"  # items sharing one SID: all of them, or first

    def __post_init__(self) -> None:
        if self.path is not None and self.random_items > 0:
            raise ValueError("`path` and `random_items` exclude each other (set random_items = 0 "
                             "to use the file)")
        if self.path is None and self.random_items <= 0:
            raise ValueError("one of `path` or `random_items` is required")
        if not self.codebook_sizes or min(self.codebook_sizes) < 1:
            raise ValueError("`codebook_sizes` must be positive")
        if self.token_offset < 2:
            raise ValueError("`token_offset` must leave room for pad (0) and eos (1)")


# A step keeps at most this many beams: the selection's largest k (kernels.trie_topk.MAX_K; a
# test holds the two equal: config imports nothing of the runtime's)
MAX_BEAMS = 1024


class PolicySpec(_Section, kw_only=True):
    """The selection policy overlay of a generate deployment."""

    beam_widths: list[int] = msgspec.field(default_factory=lambda: [16, 16, 16])  # per step
    top_k: int = 10  # default number of items returned
    max_top_k: int = 1024
    max_context_items: int = 256  # history items the encoder reads (the newest)
    append_eos: bool = True
    max_per_prefix: int = 0  # answered items per first SID code (diversity); 0: no cap

    def __post_init__(self) -> None:
        if not self.beam_widths or min(self.beam_widths) < 1 or max(self.beam_widths) > MAX_BEAMS:
            raise ValueError(f"`beam_widths` must be in 1..{MAX_BEAMS}")
        if not 1 <= self.max_top_k <= MAX_BEAMS:  # the answer is the last step's beams
            raise ValueError(f"`max_top_k` must be in 1..{MAX_BEAMS}")
        if not 1 <= self.top_k <= self.max_top_k:
            raise ValueError(f"`top_k` must be in 1..max_top_k ({self.max_top_k})")
        if self.max_context_items < 1:
            raise ValueError("`max_context_items` must be >= 1")
        if self.max_per_prefix < 0:
            raise ValueError("`max_per_prefix` must be >= 0 (0: no cap)")


class Spec(_Section, kw_only=True):
    name: str = "unnamed"
    model: ModelSpec
    engine: EngineSpec = msgspec.field(default_factory=EngineSpec)
    cache: CacheSpec = msgspec.field(default_factory=CacheSpec)
    # A second, generate model beside an HSTU `model`: the engine then serves both.
    generator: ModelSpec | None = None
    catalog: CatalogSpec | None = None
    policy: PolicySpec = msgspec.field(default_factory=PolicySpec)

    def __post_init__(self) -> None:
        gen = self.model if self.model.family == "t5" else self.generator
        if gen is not None and gen.family != "t5":
            raise ValueError("`generator.family` must be \"t5\"")
        if gen is not None and self.catalog is None:
            raise ValueError("a generate model needs a [catalog] section")
        if gen is not None and self.catalog and len(self.policy.beam_widths) != len(self.catalog.codebook_sizes):
            raise ValueError(f"`policy.beam_widths` has {len(self.policy.beam_widths)} steps, the "
                             f"SIDs have {len(self.catalog.codebook_sizes)} levels")

    @property
    def generate_model(self) -> ModelSpec | None:
        return self.model if self.model.family == "t5" else self.generator

    @property
    def rank_limits(self) -> dict[str, int] | None:
        """The rank model's table sizes and request limits, as ``stats()`` reports them (a
        replay against a server folds a trace's ids into them); None: no rank model."""
        m = self.model
        return None if m.family != "hstu" else {k: int(getattr(m, k)) for k in RANK_LIMITS}


BUILTIN_SPECS = ("rank-small", "rank-ref", "gen-small", "gen-ref")
RANK_LIMITS = ("num_items", "num_actions", "max_history", "max_candidates")  # Spec.rank_limits

_PATH_RE = re.compile(r"`\$((?:\.[A-Za-z_][\w-]*|\[\d+\])*)`")


def key_path(msg: str) -> str:
    """Turn msgspec's ``... - at `$.model.x` `` into ``model.x``."""
    m = _PATH_RE.search(msg)
    return m.group(1).lstrip(".") if m else ""


def _section_keys(where: str) -> list[str]:
    """The valid keys of the section at a dotted path (``""`` is the root)."""
    cls: Any = Spec
    for part in [p for p in where.split(".") if p]:
        field = next((f for f in msgspec.structs.fields(cls) if f.name == part), None)
        if field is None:
            return []
        t = field.type
        args = getattr(t, "__args__", ())
        cls = next((a for a in (t, *args) if isinstance(a, type) and issubclass(a, msgspec.Struct)), None)
        if cls is None:
            return []
    return [f.name for f in msgspec.structs.fields(cls)]


def _spec_error(err: msgspec.ValidationError, source: str,
                overrides: Mapping[str, Any] | None = None) -> SpecError:
    msg = str(err)
    where = key_path(msg)
    head = msg.split(" - at ")[0]
    unknown = re.match(r"Object contains unknown field `([^`]+)`", head)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        near = difflib.get_close_matches(unknown.group(1), _section_keys(where), n=1)
        hint = f" (did you mean `{where + '.' if where else ''}{near[0]}`?)" if near else ""
        origin = source if key not in (overrides or {}) else "--set"
        return SpecError(f"{origin}: unknown key `{key}`{hint}")
    missing = re.match(r"Object missing required field `([^`]+)`", head)
    if missing:
        key = f"{where}.{missing.group(1)}" if where else missing.group(1)
        return SpecError(f"{source}: missing key `{key}`")
    if where and where in (overrides or {}):
        return SpecError(f"--set {where}={overrides[where]}: `{where}`: {head}")
    return SpecError(f"{source}: `{where or '(root)'}`: {head}")


def parse_override_value(text: str) -> Any:
    """A CLI value as TOML (``8``, ``2.5``, ``true``, ``"x"``, ``[1, 2]``), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# Keys of which a spec holds one: overriding one drops the other's value from the file.
_EXCLUSIVE = {"checkpoint": "init_seed", "init_seed": "checkpoint", "path": "random_items",
              "random_items": "path"}


def parse_set_pairs(pairs: list[str] | None) -> dict[str, str]:
    """``--set KEY=VALUE`` arguments as overrides for ``load_spec`` (values parsed there)."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecError(f"--set {pair!r}: expected KEY=VALUE, e.g. cache.mode=recompute")
        out[key.strip()] = value.strip()
    return out


def apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Set dotted keys in a raw spec dict (a copy). Unknown keys are caught by decoding later.
    The value ``none`` (or ``None`` from code) removes a key, so it takes its default; setting
    ``model.checkpoint`` drops the file's ``model.init_seed`` (and the reverse), likewise
    ``catalog.path`` and ``catalog.random_items``."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    overrides = dict(overrides or {})
    for dotted in list(overrides):
        head, _, last = dotted.rpartition(".")
        other = _EXCLUSIVE.get(last)
        if other and f"{head}.{other}" not in overrides and isinstance(out.get(head), dict):
            out[head] = {k: v for k, v in out[head].items() if k != other}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if not all(parts):
            raise SpecError(f"override `{dotted}`: not a dotted key like `cache.mode`")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise SpecError(f"override `{dotted}`: `{part}` is not a section")
            node = child
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            node.pop(parts[-1], None)
            continue
        # msgspec rejects a str where an int is due; a CLI value arrives as str, so parse it.
        node[parts[-1]] = parse_override_value(value) if isinstance(value, str) else value
    return out


def decode_spec(raw: Mapping[str, Any], source: str = "spec",
                overrides: Mapping[str, Any] | None = None) -> Spec:
    try:
        return msgspec.convert(dict(raw), Spec, strict=True)
    except msgspec.ValidationError as err:
        raise _spec_error(err, source, overrides) from None


def _builtin_path(name: str) -> Path | None:
    here = Path(__file__).resolve().parent.parent / "pipeline" / f"{name}.toml"
    if here.is_file():  # running from a source tree
        return here
    try:
        res = resources.files("streamgr._pipeline").joinpath(f"{name}.toml")
    except ModuleNotFoundError:
        return None
    return Path(str(res)) if res.is_file() else None


def resolve_spec_path(path_or_name: str | Path) -> Path:
    p = Path(path_or_name)
    if p.is_file():
        return p
    builtin = _builtin_path(str(path_or_name))
    if builtin is not None:
        return builtin
    if p.is_dir():  # (a checkpoint directory from init-model holds its spec.toml)
        hint = f"; did you mean {p / 'spec.toml'}?" if (p / "spec.toml").is_file() else ""
        raise SpecError(f"spec `{path_or_name}` is a directory, not a spec file{hint}")
    raise SpecError(f"spec `{path_or_name}`: no such file, and not a built-in spec "
                    f"({', '.join(BUILTIN_SPECS)})" + "".join(f"; did you mean {n}?" for n in
                    difflib.get_close_matches(str(path_or_name), BUILTIN_SPECS, n=1)))


def load_spec(path_or_spec: str | Path | Spec | Mapping[str, Any],
              overrides: Mapping[str, Any] | None = None) -> Spec:
    """A ``Spec`` from a TOML path, a built-in name, a ``Spec`` or a raw dict, with overrides."""
    if isinstance(path_or_spec, Spec):
        raw = msgspec.to_builtins(path_or_spec)
        source = f"spec {path_or_spec.name}"
    elif isinstance(path_or_spec, Mapping):
        raw, source = dict(path_or_spec), "spec"
    else:
        path = resolve_spec_path(path_or_spec)
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise SpecError(f"{path}: not valid TOML: {err}") from None
        source = str(path)
        for section, key in (("model", "checkpoint"), ("generator", "checkpoint"),
                             ("catalog", "path")):
            val = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
            if isinstance(val, str) and not Path(val).is_absolute():
                # Relative paths are relative to the spec file, so specs travel with models.
                raw[section][key] = str((path.parent / val).resolve())
    if overrides:
        source = f"{source} (with --set {', '.join(f'{k}={v}' for k, v in overrides.items())})"
    spec = decode_spec(apply_overrides(raw, overrides), source, overrides)
    return spec
