"""Building what an engine serves from its spec: the device and dtype, the rank runner (its
model, history store, cache manager and stores, rank plans) and the generate runner. Cache
sizes are checked against the machine before anything is allocated."""

from __future__ import annotations

import torch

from ..cache import HistoryStore, KVCacheManager
from ..cache.store import KVStores
from ..errors import StreamgrError
from ..models import build_ranker
from ..models.checkpoint import HostStaging, fp32_checkpoint_bytes
from .cached_rank import CachedRankRunner
from .generate import GenerateRunner, GenerateVersion, WeightsOnly
from .preflight import check_cache_memory
from .rank import RankRunner


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise StreamgrError("engine.device = \"cuda\" but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Builder:
    """Models and runners of one engine; counts loads so a reloaded checkpoint is a new
    version even at the same path."""

    def __init__(self, spec, device: torch.device, dtype: torch.dtype) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        # The host buffer checkpoint refits read into (pinned on CUDA; see generate_runner).
        self.staging = HostStaging(pin=device.type == "cuda")
        self.loads = 0
        self.versions = 0  # generate versions built (g1, g2, ...)

    def ranker(self, model_spec):
        model, source = build_ranker(model_spec, self.device, self.dtype, self.staging)
        self.loads += 1
        return model, f"{self.loads}:{source}"

    def rank_runner(self, model, version: str) -> RankRunner:
        if self.spec.engine.refit_spare:
            self._pin_for(model)
        history = HistoryStore(self.spec.engine.history_events)
        c = self.spec.cache
        if c.mode == "recompute":
            return self._with_plans(RankRunner(model, version, self.device, history), None, 1)
        hierarchical = c.mode == "hierarchical"
        cfg = model.cfg
        check_cache_memory(c, cfg.num_layers, cfg.num_heads, cfg.head_dim, self.dtype,
                           self.device, hierarchical)
        manager = KVCacheManager(c.page_tokens, c.chunk_tokens, c.device_pages,
                                 c.host_chunks if hierarchical else 0, c.offload_quota_tokens,
                                 hierarchical=hierarchical)
        stores = KVStores(cfg.num_layers, cfg.num_heads, cfg.head_dim, c.page_tokens,
                          c.chunk_tokens, c.device_pages, c.host_chunks if hierarchical else 0,
                          self.dtype, self.device, c.host_pinned, c.host_huge_pages)
        runner = self._with_plans(CachedRankRunner(model, version, self.device, history, manager,
                                                   stores), stores.pages, c.page_tokens)
        if hierarchical and c.onload_split == "auto":
            from ..cache.onload_split import SplitFeedback
            from .onload_costs import measure_split_costs
            runner.onload_split = measure_split_costs(runner)
            runner.split_feedback = SplitFeedback()  # (updates from device timings only)
        elif hierarchical:
            runner.onload_split = float(c.onload_split)
        return runner

    def _with_plans(self, runner: RankRunner, store, page_tokens: int) -> RankRunner:
        """Rank plans (CUDA graphs of the forward) where their kernels run."""
        from ..kernels import host_loops
        from .rank_plans import RankPlans
        host_loops.warm()  # the batch's compiled host loops: compiled now, not in a first batch
        if self.device.type == "cuda":  # the CUDA attention plans every batch on the host:
            from ..kernels import hstu_attention_cuda, hstu_plan  # compile that planner now
            hstu_plan.warm()
            hstu_attention_cuda.warm(self.device)  # and its kernels (wgmma: NVRTC, seconds)
        n = self.spec.engine.rank_plans
        if n and RankPlans.usable(runner.model, self.device):
            runner.plans = RankPlans(runner.model, self.spec.engine.max_batch, n, store,
                                     page_tokens, self.device)
        return runner

    def generate_weights(self, spec, like: GenerateVersion, into, on_read=None) -> WeightsOnly:
        """New weights for a refit in place into the model ``into`` (same architecture, else
        ``ContractError``), checked against ``like``'s catalog and trie (reused), with a new
        version name, without building a whole version. From a checkpoint: its tensors on the
        device, no model built (``on_read()`` once it is read, before they move); from an init
        seed: a model."""
        from ..runtime.contract import same_architecture
        from ..runtime.deployment import build_generator, refit_tensors
        model = tensors = None
        if spec.generate_model.checkpoint is not None:
            tensors, source, contract = refit_tensors(spec, self.device, self.dtype, into,
                                                      like.trie, on_read, self.staging)
        else:
            model, source, _, contract, _ = build_generator(
                spec, self.device, self.dtype, catalog=like.catalog, trie=like.trie)
            same_architecture(model.cfg, into.cfg)
        self.loads += 1
        self.versions += 1
        return WeightsOnly(f"g{self.versions}", model, f"{self.loads}:{source}", contract,
                           tensors=tensors)

    def generate_runner(self) -> GenerateRunner:
        runner = GenerateRunner(self.generate_version(self.spec))
        if self.spec.engine.refit_spare:
            runner.spare = self.spare_of(runner.active)
            self._pin_for(runner.active.model)
        return runner

    def _pin_for(self, model) -> None:
        """Pin the refit buffer now, before serving, for an fp32 checkpoint of ``model``:
        pinning gen-ref's ~200 MB at the first refit held the driver ~150 ms beside serving
        (one request's p99 12x, session 14). A larger checkpoint grows it then."""
        if self.staging.pin:
            self.staging.take(fp32_checkpoint_bytes(model.state_dict().values()))

    def spare_of(self, act: GenerateVersion) -> GenerateVersion:
        """A version sharing ``act``'s catalog, trie and policy with its own copy of the
        spec's weights (built again, not deep-copied: a copy would clone the head's weight out
        of its aligned buffer, and a refit written into it would miss the head): storage for
        weights refits in place (``GenerateRunner.refit_slot``), never served."""
        spare = self.generate_version(self.spec, catalog=act.catalog,
                                      catalog_name=act.catalog_name, trie=act.trie,
                                      policy_name=act.policy_name)
        spare.name = f"{act.name}-spare"
        return spare

    def generate_version(self, spec, model=None, weights: str | None = None, catalog=None,
                         catalog_name: str | None = None, trie=None,
                         policy_name: str | None = None) -> GenerateVersion:
        """A generate version of ``spec`` (its model spec, catalog and policy), reusing a
        loaded ``model`` and a built ``catalog``/``trie`` where given; contract-checked."""
        from ..runtime.deployment import build_generator
        gmodel, source, trie, contract, catalog = build_generator(
            spec, self.device, self.dtype, model=model, catalog=catalog, trie=trie)
        if model is None:
            self.loads += 1
            weights = f"{self.loads}:{source}"
        self.versions += 1
        cat = spec.catalog
        return GenerateVersion(
            f"g{self.versions}", gmodel, weights, catalog,
            catalog_name or (f"file:{cat.path}" if cat.path else f"random:{cat.random_items}:"
                                                                f"{cat.random_seed}"),
            trie, spec.policy, policy_name or "spec", contract, spec)
