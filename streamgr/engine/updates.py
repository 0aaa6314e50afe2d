"""Live updates of what an engine serves: versioned, contract-checked, atomic cutovers.

RecoGEM (section 3.3) prepares the next version of the weights, the SID vocabulary and the
selection policy beside the active one, validates it against the deployment contract outside
the request path, then publishes it by a pointer switch; each request runs on one consistent
view. Here:

- ``update(weights=, catalog=, policy=)`` builds the new generate version on a worker thread
  (a checkpoint load, a trie build: ~0.6 s for a million items), checks it against the contract
  (a change that breaks it raises ``ContractError`` naming the field, and the active version
  keeps serving), captures its decode plans of the common shapes on that worker thread (CUDA;
  the executor keeps serving), then activates it on the executor, between two batches: a
  batch already submitted finishes on the old version, queued requests run on the new one.
  Rank takes new weights the same way (cached K/V of older weights are never served: the
  cache validates the version).
- The previous version stays loaded for ``rollback()`` until the next update (or
  ``keep_previous=False``), so a rollback is a cutover too, with no load.
- An update that keeps the policy is written into a retired version (the spare that
  ``keep_previous=False`` keeps, or the previous one this update replaces) instead
  (``GenerateRunner.refit``): new weights into its tensors, and a new catalog whose trie has
  the same shapes (levels, widest fan-outs; every version owns device tables with room to
  spare) into its trie tables. Its decode plans stay valid, so a stream of weight refits and
  catalog changes captures nothing after the first two versions; a catalog that changes the
  trie's shapes, or a policy change, builds a version.
- Updates run one at a time (a lock); ``versions()`` names what is active and what is kept.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from ..errors import ContractError, StreamgrError, UnsupportedRequest
from ..selection.trie_delta import trie_without
from ..selection.catalog import Catalog, CatalogDelta, apply_delta, load_catalog
from ..runtime.deployment import build_generator
from ..streams import off_stream
from .generate import CatalogRefit, catalog_views, views_after_removal
from .resources import check_loop

log = logging.getLogger("streamgr.engine")

Target = Literal["auto", "rank", "generate"]


WARM_BUILDS = 3  # catalog builds alive at once in a live update (the new, active, previous)


def _weights_spec(model_spec, weights):
    """The model spec for ``weights``: a checkpoint directory (str/Path) or an init seed (int)."""
    if isinstance(weights, bool) or not isinstance(weights, (str, Path, int)):
        raise StreamgrError("weights: a checkpoint directory or an int init seed")
    if isinstance(weights, int):
        return msgspec.structs.replace(model_spec, checkpoint=None, init_seed=weights)
    return msgspec.structs.replace(model_spec, checkpoint=str(weights), init_seed=None)


def merged_policy(current, changes, depth: int):
    """The current policy with ``changes`` (a PolicySpec or a dict of its fields) applied and
    validated against SIDs of ``depth`` levels; errors name the field."""
    from ..config import PolicySpec, key_path
    if not isinstance(changes, (dict, PolicySpec)):
        raise ContractError(f"policy: a dict of policy fields or a PolicySpec, got "
                            f"{type(changes).__name__}")
    fields = changes if isinstance(changes, dict) else msgspec.structs.asdict(changes)
    unknown = sorted(set(fields) - set(PolicySpec.__struct_fields__))
    if unknown:
        raise ContractError(f"policy.{unknown[0]}: not a policy field "
                            f"({', '.join(PolicySpec.__struct_fields__)})")
    try:
        pol = msgspec.convert({**msgspec.structs.asdict(current), **fields}, PolicySpec)
    except (msgspec.ValidationError, ValueError) as err:  # the message names the field
        where, head = key_path(str(err)), str(err).split(" - at ")[0]
        if not where and (m := re.match(r"`(\w+)` (.*)", head)):  # the policy's own checks
            where, head = m[1], m[2]
        raise ContractError(f"policy.{where}: {head}" if where else f"policy: {head}") from None
    if len(pol.beam_widths) != depth:
        raise ContractError(f"policy.beam_widths: {len(pol.beam_widths)} steps for SIDs of "
                            f"depth {depth}")
    return pol


def same_contract(old: dict, new: dict) -> None:
    """A new version may change weights' values, the catalog's items and the policy, not what
    the runtime was built around: the model's shape and the SID vocabulary's layout."""
    for section in ("model", "vocabulary"):
        for key, value in old[section].items():
            if new[section].get(key) != value:
                raise ContractError(f"{section}.{key}: {new[section].get(key)!r}, the engine "
                                    f"serves {value!r}")


_RUNNING: set[asyncio.Task] = set()  # updates whose callers stopped waiting


async def _to_the_end(coro) -> None:
    """Run an update or rollback to its end even if its caller is cancelled (a timeout): its
    steps run on threads that cannot be stopped, so a cancel between them would leave a
    version cut over with the bookkeeping after it undone (no rollback kept). The caller
    still gets its CancelledError; ``versions()`` tells where the update stands."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():  # kept to its end, its outcome logged
            _RUNNING.add(task)
            task.add_done_callback(_finished)
        raise


def _finished(task: asyncio.Task) -> None:
    _RUNNING.discard(task)
    if task.cancelled() or task.exception() is not None:
        log.warning("an update whose caller stopped waiting failed: %r",
                    "cancelled" if task.cancelled() else task.exception())
    else:
        log.info("an update whose caller stopped waiting is done")


def _marked(marks: dict, name: str, fn, *args):
    """``fn(*args)`` after marking when it started (``name``: the wait before it ended)."""
    marks[name] = time.perf_counter()
    return fn(*args)


class Updates:
    """Mixed into ``Engine``: ``update``, ``rollback``, ``versions`` (and ``update_weights``)."""

    def _init_updates(self) -> None:
        self._updating = asyncio.Lock()  # live updates, one at a time
        # the last updates' phase end times (perf_counter s), for benchmarks
        self.update_phases: deque = deque(maxlen=64)

    def _target(self, target: Target, generate_only: bool) -> str:
        if target not in ("auto", "rank", "generate"):
            raise StreamgrError(f"target {target!r}: auto, rank or generate")
        if target == "auto":
            if self.gen_runner is not None and (self.runner is None or generate_only):
                return "generate"
            if self.runner is not None and self.gen_runner is None:
                return "rank"
            raise StreamgrError("this engine serves rank and generate: say target=\"rank\" or "
                                "target=\"generate\"")
        if target == "rank" and self.runner is None or target == "generate" and \
                self.gen_runner is None:
            raise UnsupportedRequest(f"spec {self.spec.name} does not serve {target}")
        return target

    async def _on_executor(self, fn, *args):
        """Run ``fn`` where batches run (between two of them), or here if not started."""
        if self._res is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._res.executor, fn, *args)

    async def _off_executor(self, fn, *args, res=None):
        """``fn`` on the build thread (``res``'s, else the started engine's; a worker thread
        before start) with its device work on a stream of its own (see
        ``streams.off_stream``), beside the batches the executor keeps running."""
        res = res or self._res
        return await asyncio.get_running_loop().run_in_executor(
            res.builder if res is not None else None, off_stream, self._build.device, fn, *args)

    async def _warm_generate(self, res) -> None:
        """At start, before serving: the decode plans of the common shapes (executor), then,
        where live updates are expected (``engine.refit_spare``), ``_warm_updates`` on the
        build thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(res.executor, self.gen_runner.warm_up)
        if self.spec.engine.refit_spare:
            self.metrics.count("update_warm_builds",
                               await self._off_executor(self._warm_updates, res=res))

    def _warm_updates(self, n: int = WARM_BUILDS) -> int:
        """Build ``n`` catalog removals of one item each, all alive at once, and drop them
        (build thread, before serving; ``engine.refit_spare`` engines): a build's arrays are
        fresh memory the first times, one page fault a page, and the first three removals
        took 3-4x as long as later ones (CPU machine: 350-530 against 108-144 ms at 1M
        items, ~8,000 faults against ~0; docs/benchmarks.md, session 19), the first round of
        live updates the slowest. Returns the builds made (0: too small a catalog)."""
        ids = self.gen_runner.active.item_ids
        if len(ids) <= 2 * n:
            return 0
        held = []
        for item in ids[:n].tolist():
            try:
                held.append(self._build_catalog(CatalogDelta(remove=[item])))
            except StreamgrError:  # a removal this catalog's contract refuses: nothing to warm
                break
        return len(held)

    async def update(self, weights=None, catalog=None, policy=None, *, target: Target = "auto",
                     keep_previous: bool = True) -> dict[str, Any]:
        """Prepare, check and cut over to a new version (see the module docstring).
        ``weights``: a checkpoint directory or an int init seed; ``catalog``: a catalog file, a
        ``Catalog``, or a ``CatalogDelta`` (or its dict) of additions and removals; ``policy``:
        a ``PolicySpec`` or a dict of the fields to change. Returns ``versions()``."""
        if weights is None and catalog is None and policy is None:
            raise StreamgrError("update: give weights, catalog or policy")
        check_loop(self._res)
        which = self._target(target, weights is None)
        if which == "rank" and (catalog is not None or policy is not None):
            raise UnsupportedRequest("rank takes new weights only")

        async def run():
            async with self._updating:
                if which == "rank":
                    await self._update_rank(weights, keep_previous)
                else:
                    await self._update_generate(weights, catalog, policy, keep_previous)
                self.metrics.count(f"{which}_updates")
        await _to_the_end(run())
        return self.versions()

    async def _update_generate(self, weights, catalog, policy, keep_previous: bool) -> None:
        runner = self.gen_runner
        keys = runner.active.plan_keys()
        cat = None
        # When each phase ended (perf_counter s), kept in ``update_phases`` for benchmarks that
        # attribute slow requests to the phase they overlapped (tools/bench_update.py).
        marks = {"start": time.perf_counter()}
        self.update_phases.append(marks)
        if catalog is not None and policy is None:  # the catalog first: a slot may take it
            cat = await self._off_executor(self._build_catalog, catalog)
            marks["catalog"] = time.perf_counter()
        slot = runner.refit_slot(cat.trie if cat else None) if policy is None else None
        if slot is not None:
            # In place: the new weights (no version build) and catalog tables written into a
            # retired version's tensors, whose decode plans stay valid; only shapes it never
            # captured are captured (worker thread).
            new = None
            if weights is not None:  # ("read": a checkpoint read; "weights": moved too)
                new = await self._off_executor(self._build_weights, weights, slot, marks)
                marks["weights"] = time.perf_counter()
            elif cat is not None:  # a catalog alone: the version's name is new too
                self._build.versions += 1
                cat.name = f"g{self._build.versions}"
            have = set(slot.plan_keys())
            missing = [k for k in keys if k not in have]
            if missing:
                await self._off_executor(slot.warm_up, missing)
                marks["capture"] = time.perf_counter()
            await self._on_executor(_marked, marks, "queued", runner.refit, slot, new,
                                    keep_previous, cat)
            marks["cutover"] = time.perf_counter()
            self.metrics.count("generate_refits_in_place")
            return
        new = await self._off_executor(self._build_generate, weights, catalog, policy, cat)
        marks["build"] = time.perf_counter()
        # Its plans before it serves: the shapes the traffic uses (or the defaults), captured
        # on a worker thread while the executor keeps serving. A capture is thread-local
        # (plans.py) into the new version's own memory pool, so the executor's replays go on
        # beside it; on the executor, each capture (an eager search, then the graph) stalled
        # every queued request (the p99 under updates: docs/benchmarks.md).
        await self._off_executor(new.warm_up, keys or None)
        marks["capture"] = time.perf_counter()
        await self._on_executor(_marked, marks, "queued", runner.activate, new, keep_previous)
        marks["cutover"] = time.perf_counter()

    def _build_weights(self, weights, slot, marks: dict | None = None):
        """New weights of the active version's catalog and policy, for a refit into ``slot``:
        contract-checked, with the slot's architecture (else the update is refused).
        ``marks``: gets "read" when a checkpoint has been read, before its tensors move."""
        act, spec = self.gen_runner.active, self.spec
        ms = _weights_spec(spec.generate_model, weights)
        spec = msgspec.structs.replace(spec, **{"model" if spec.model.family == "t5"
                                                else "generator": ms}, policy=act.policy)
        on_read = None if marks is None else (
            lambda: marks.__setitem__("read", time.perf_counter()))
        new = self._build.generate_weights(spec, act, slot.model, on_read)
        same_contract(act.contract, new.contract)
        new.pair_with(slot)
        return new

    def _catalog_of(self, catalog) -> tuple:
        """(Catalog, its name, the CatalogDelta it applied or None) of an update's ``catalog``
        argument."""
        act, sizes = self.gen_runner.active, self.spec.catalog.codebook_sizes
        if isinstance(catalog, (str, Path)):
            return load_catalog(catalog, sizes), f"file:{catalog}", None
        if isinstance(catalog, Catalog):
            return catalog, f"object:{len(catalog.item_ids)}", None
        try:
            delta = msgspec.convert(catalog, CatalogDelta, strict=False) \
                if isinstance(catalog, dict) else catalog
        except msgspec.ValidationError as err:
            raise ContractError(f"catalog: {err}") from None
        if not isinstance(delta, CatalogDelta):
            raise StreamgrError("catalog: a file, a Catalog or a CatalogDelta")
        return (apply_delta(act.catalog, delta, sizes),
                f"{act.catalog_name}+{len(delta.add)}-{len(delta.remove)}", delta)

    def _build_catalog(self, catalog) -> CatalogRefit:
        """A new catalog for the active weights and policy (worker thread): its trie, checked
        against the contract, the views requests are prepared with, and its tables staged on
        the device for a retired version's to take in place (~3 arrays a level; a version
        built instead when none fits uploads its own)."""
        act = self.gen_runner.active
        cat, cname, delta = self._catalog_of(catalog)
        spec = msgspec.structs.replace(self.spec, policy=act.policy)
        trie = None
        if delta is not None and delta.remove and not delta.add:  # removals only: the trie
            gone = np.isin(act.trie.leaf_items, np.asarray(delta.remove, dtype=np.int64))
            trie = trie_without(act.trie, gone)  # changed in place of one built again
        _, _, trie, contract, cat = build_generator(spec, self._build.device, self._build.dtype,
                                                    model=act.model, catalog=cat, trie=trie)
        same_contract(act.contract, contract)
        views = (views_after_removal((act.item_ids, act.index, act._tokens), delta.remove)
                 if delta is not None and not delta.add else catalog_views(trie))
        return CatalogRefit("", cat, cname, trie, views,
                            trie.staged(act.model.shared.weight.device), contract)

    def _build_generate(self, weights, catalog, policy, cat: CatalogRefit | None = None):
        act, spec = self.gen_runner.active, self.spec
        model, wname = act.model, act.weights
        if weights is not None:
            ms = _weights_spec(spec.generate_model, weights)
            spec = msgspec.structs.replace(spec, **{"model" if spec.model.family == "t5"
                                                    else "generator": ms})
            model = wname = None
        c, trie, cname = act.catalog, act.trie, act.catalog_name
        if cat is not None:  # built already (no slot took it)
            c, trie, cname = cat.catalog, cat.trie, cat.catalog_name
        elif catalog is not None:
            c, cname, _ = self._catalog_of(catalog)
            trie = None
        pol, pname = act.policy, act.policy_name
        if policy is not None:
            pol = merged_policy(act.policy, policy, act.trie.depth)
            pname = f"p{self._build.versions + 1}"
        spec = msgspec.structs.replace(spec, policy=pol)
        new = self._build.generate_version(spec, model=model, weights=wname, catalog=c,
                                           catalog_name=cname, trie=trie, policy_name=pname)
        same_contract(act.contract, new.contract)
        return new

    async def _update_rank(self, weights, keep_previous: bool) -> None:
        new_spec = _weights_spec(self.spec.model, weights)
        model, version = await self._off_executor(self._build.ranker, new_spec)
        if model.cfg != self.runner.model.cfg:
            raise ContractError(f"model: new weights have architecture {model.cfg}, the engine "
                                f"serves {self.runner.model.cfg}")
        old = (self.runner.model, self.runner.version)
        await self._on_executor(self.runner.set_model, model, version)
        self._rank_previous = old if keep_previous else None

    async def rollback(self, target: Target = "auto") -> dict[str, Any]:
        """Back to the previous version (kept since the last update), by the same cutover."""
        check_loop(self._res)
        which = self._target(target, True)

        async def run():
            async with self._updating:
                if which == "generate":
                    if self.gen_runner.previous is None:
                        raise StreamgrError("no previous generate version to roll back to")
                    await self._on_executor(self.gen_runner.rollback)
                else:
                    prev = getattr(self, "_rank_previous", None)
                    if prev is None:
                        raise StreamgrError("no previous rank weights to roll back to")
                    cur = (self.runner.model, self.runner.version)
                    await self._on_executor(self.runner.set_model, *prev)
                    self._rank_previous = cur
                self.metrics.count(f"{which}_rollbacks")
        await _to_the_end(run())
        return self.versions()

    def versions(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.runner is not None:
            prev = getattr(self, "_rank_previous", None)
            out["rank"] = {"active": self.runner.version, "previous": prev[1] if prev else None}
        if self.gen_runner is not None:
            g = self.gen_runner
            out["generate"] = {"active": g.active.describe(),
                               "previous": g.previous.describe() if g.previous else None}
        return out

    async def update_weights(self, checkpoint: str | None = None,
                             init_seed: int | None = None) -> str:
        """New rank weights (the first round's call; ``update`` is the general one). Returns
        the new weights version."""
        if self.runner is None:
            raise UnsupportedRequest("update_weights reloads the rank model; this spec has none")
        if (checkpoint is None) == (init_seed is None):
            raise StreamgrError("give exactly one of checkpoint or init_seed")
        await self.update(weights=checkpoint if checkpoint is not None else init_seed,
                          target="rank")
        return self.runner.version
