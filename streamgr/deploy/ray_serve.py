"""Scale-out on Ray Serve: one engine replica per GPU, users routed to the replica holding
their K/V (the optional extra ``streamgr[ray]``).

- ``StreamgrReplica``: a Serve deployment whose replica owns one ``Engine`` (a spec and
  overrides; ``num_gpus=1`` on GPU machines). Its methods take ``(user_id, request)``: the user
  comes first so the router can read it. Results come back as ``(result, replica)``: the
  result's stats name the version, the second item the replica that answered.
- ``UserAffinityRouter``: rendezvous (highest-random-weight) hashing of ``user_id`` over the
  live replicas' Serve ranks, returned as ranked choices: the user's own replica first, the
  next-ranked after it, so Serve spills to the next one only when the first is full
  (``max_ongoing_requests``); losing a replica moves only its users, and its replacement (which
  takes its rank) gets them back.
- Live updates reach every replica through an ``UpdateLog`` actor (``update_log.py``, one per
  application): the driver appends a change; every replica polls the log, applies what it has
  not applied yet, in order, and acknowledges; ``RayEngine.update`` returns once every live
  replica has, or raises the error of a change they refused (as the embedded engine would). A
  replacement replica replays the whole log, so it serves the same version as the others.
  (Serve's ``user_config`` would do the fan-out, but redeploying from Python gives the app a
  new code version, and Serve then replaces the replicas, caches and all.)
- ``RayEngine``: the engine surface (``submit_rank``, ``generate``, ``stats``, ``update``, ...)
  over a deployment handle, so ``streamgr.server.Server`` (the socket protocol) and Python
  callers use a Ray deployment as they use an embedded engine. A request whose replica dies is
  retried once on the next-ranked replica (rank and generate are idempotent), then fails with
  ``ReplicaUnavailable`` (retryable), never hangs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from typing import Any

import msgspec
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..api import GenerateRequest, RankRequest
from ..errors import ReplicaUnavailable, StreamgrError
from .update_log import Reports, refusal, update_log, update_log_name

log = logging.getLogger("streamgr.deploy")

APP = "streamgr"


def hrw_order(user_id, replica_ids: list[str]) -> list[str]:
    """Replica ids by rendezvous weight for ``user_id``, highest first (stable across
    processes: a keyed BLAKE2 hash, not Python's salted ``hash``)."""
    key = str(user_id).encode()

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(key, key=rid.encode()[:64], digest_size=8).digest()
    return sorted(replica_ids, key=weight, reverse=True)


def replica_rank(replica) -> int | None:
    """A replica's Serve rank as the router sees it: from its static metadata (recorded once
    when it became ready, so known from its first request on), else from its periodic routing
    stats (which arrive up to a stats period later: users hashed before then would have
    landed elsewhere first, splitting their cache), else None."""
    for source in ("replica_metadata", "routing_stats"):
        info = getattr(replica, source, None)
        if isinstance(info, dict) and isinstance(info.get("rank"), int):
            return info["rank"]
    return None


REPORT_WAIT_S = 0.5  # the most ``RayEngine.stats`` waits for the replicas' first reports

# How long a user's request waits (Serve's backoff) for a replica's rank to reach the router
# before it is routed without it. Hashing without every rank would send a user's first
# requests elsewhere than its later ones (the cache split over two replicas): seen right after
# a deployment started, before its replicas' ranks were known.
RANK_WAIT_S = 2.0


class UserAffinityRouter(RequestRouter):
    """Each user's requests to the same replica while it lives (see the module docstring)."""

    def _wait_for_ranks(self, unknown: list) -> bool:
        """Whether a replica of ``unknown`` (no rank known yet) appeared less than
        ``RANK_WAIT_S`` ago: the request waits for its rank rather than hash without it."""
        since = self.__dict__.setdefault("_rank_unknown_since", {})
        now = time.monotonic()
        return any(now - since.setdefault(r.replica_id.unique_id, now) < RANK_WAIT_S
                   for r in unknown)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        args = pending_request.args if pending_request is not None else None
        if not args:  # not a user's request (stats, versions): any replica
            return [candidate_replicas]
        # Hash on the replica's Serve rank (0..N-1): a replacement takes the rank of the
        # replica it replaces, so its users come back to it and no other user moves. A replica
        # whose rank is still not known after RANK_WAIT_S only takes spill-over.
        ranks = {id(r): replica_rank(r) for r in candidate_replicas}
        unknown = [r for r in candidate_replicas if ranks[id(r)] is None]
        if unknown and pending_request is not None and self._wait_for_ranks(unknown):
            pending_request.routing_context.should_backoff = True  # else Serve asks again at once
            return []
        ranked = {f"rank{ranks[id(r)]}": r for r in candidate_replicas
                  if ranks[id(r)] is not None}
        rest = [r for r in candidate_replicas if r not in ranked.values()]
        if not ranked:
            ranked, rest = {r.replica_id.unique_id: r for r in candidate_replicas}, []
        order = [[ranked[k]] for k in hrw_order(args[0], list(ranked))]
        return order + ([rest] if rest else [])


class StreamgrReplica:
    """One engine per replica (wrapped by ``serve.deployment`` in ``deployment``). Its
    constructor is async (Serve awaits it on the replica's event loop): the replica counts as
    started, and takes requests, once its engine has started and caught up with the update
    log, so no request waits for an engine's start (gen-ref's: ~30 s on the H200) or answers
    from the spec's version, and a start that fails fails the replica where Serve reports it."""

    async def __init__(self, spec, overrides: dict | None = None,
                       app: str = "streamgr") -> None:
        from ..engine.core import Engine  # torch loads in the replica, not the driver
        self.engine = Engine.from_spec(spec, overrides or {})
        try:
            ctx = serve.get_replica_context()
            self.serve_rank = int(getattr(ctx.rank, "rank", ctx.rank))
            self.replica = f"{self.serve_rank}:{ctx.replica_id.unique_id}"  # rank:id
        except Exception:  # outside Serve (tests of the class itself)
            self.serve_rank, self.replica = 0, f"0:local-{os.getpid()}"
        self.applied = 0  # how many of the update log's changes this replica has applied
        self.app = app
        self._start: asyncio.Future | None = None
        self._poller: asyncio.Task | None = None
        await self._ready()

    async def _ready(self) -> None:
        if self._start is None:
            self._start = asyncio.ensure_future(self._boot())
        await asyncio.shield(self._start)

    async def _boot(self) -> None:
        """Start the engine and catch up with the update log before the first request (a
        replacement replica must not answer from the spec's version), then follow the log."""
        await self.engine.start()
        await self._apply_log()
        self._poller = asyncio.ensure_future(self._follow_updates())

    async def _apply_log(self) -> None:
        """Apply the changes of the application's update log this replica has not applied, in
        order, and acknowledge, with the error of each change it refused (the engine's
        contract and checkpoint checks: the replica keeps serving its version, and the
        driver's ``update`` raises that error instead of reporting success)."""
        try:
            log_actor = ray.get_actor(update_log_name(self.app), namespace="streamgr")
        except ValueError:  # no log: nothing was ever updated
            return
        refused: dict[int, tuple[str, str]] = {}
        for change in await log_actor.since.remote(self.applied):
            change = dict(change)
            try:
                if change.pop("rollback", False):
                    await self.engine.rollback(target=change.get("target", "auto"))
                else:
                    await self.engine.update(**change)
            except StreamgrError as err:
                log.error("replica %s: update %d failed: %s", self.replica, self.applied + 1,
                          err)
                refused[self.applied + 1] = (err.code, str(err))
            self.applied += 1
        await log_actor.ack.remote(self.replica, self.applied, refused, msgspec.to_builtins(
            {"versions": self.engine.versions(), "stats": self.engine.stats()}))

    async def _follow_updates(self, every: float = 0.2) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self._apply_log()
            except Exception as err:  # the log actor restarting: try again
                log.warning("replica %s: update log unavailable: %r", self.replica, err)

    async def rank(self, user_id, request: RankRequest):
        await self._ready()
        return await self.engine.rank(request), self.replica

    async def generate(self, user_id, request: GenerateRequest):
        await self._ready()
        return await self.engine.generate(request), self.replica

    async def stats(self) -> dict:
        await self._ready()
        return {**self.engine.stats(), "replica": self.replica, "updates_applied": self.applied}

    async def versions(self) -> dict:
        await self._ready()
        return {**self.engine.versions(), "replica": self.replica, "updates_applied": self.applied}

    def record_replica_metadata(self) -> dict:  # read by UserAffinityRouter, once at ready
        return {"rank": self.serve_rank}

    def record_routing_stats(self) -> dict:  # the same, for a Ray without replica metadata
        return {"rank": self.serve_rank}

    def check_health(self) -> None:  # Serve's health check: a dead engine gets replaced
        if self.engine._dead is not None:
            raise RuntimeError(f"engine is dead: {self.engine._dead!r}")




def deployment(spec, overrides: dict | None = None, replicas: int = 2, router: str = "affinity",
               gpus: float | None = None, max_ongoing_requests: int = 256, app: str = "streamgr"):
    """The Serve application: ``replicas`` engine replicas behind the chosen router
    (``"affinity"`` or Ray's ``"default"``). ``gpus`` per replica: 1 on GPU machines (the
    default when CUDA is visible to the driver), 0 on the CPU."""
    if gpus is None:
        import torch
        gpus = 1.0 if torch.cuda.is_available() else 0.0
    actor: dict[str, Any] = {"num_gpus": gpus, "num_cpus": 1}
    if not gpus:  # a CPU replica computes on its one CPU: torch's threads sized to it
        actor["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    opts: dict[str, Any] = dict(num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
                                ray_actor_options=actor,
                                health_check_period_s=2, health_check_timeout_s=30)
    if router == "affinity":
        # By import path: a class object is pickled anew on every deploy, which Serve takes
        # for a code change and answers by replacing the replicas (their caches lost) instead
        # of reconfiguring them in place.
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class="streamgr.deploy.ray_serve:UserAffinityRouter",
            request_routing_stats_period_s=1, request_routing_stats_timeout_s=5)
    elif router != "default":
        raise StreamgrError(f"router {router!r}: affinity or default")
    return serve.deployment(StreamgrReplica, name="StreamgrReplica", **opts).bind(spec, overrides,
                                                                              app)


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at ``address`` (default ``RAY_ADDRESS``; none: start a local one),
    once per process."""
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), log_to_driver=False,
                 include_dashboard=False)


def build_app(args: dict):
    """Serve's application builder (``import_path: streamgr.deploy.ray_serve:build_app`` in a
    Serve config file; ``streamgr ray-config`` writes one): ``args`` are ``deployment``'s."""
    return deployment(args["spec"], args.get("overrides") or {}, int(args.get("replicas", 2)),
                      args.get("router", "affinity"), args.get("gpus"),
                      int(args.get("max_ongoing_requests", 256)), args.get("app", APP))


def serve_config(spec: str, overrides: dict | None = None, replicas: int = 2,
                 router: str = "affinity", gpus: float | None = None) -> dict:
    """A Serve config (``serve run`` / ``serve deploy``, or a RayService's serveConfigV2)."""
    if replicas < 1:  # else a config the cluster refuses at deploy
        raise StreamgrError(f"--replicas must be at least 1, got {replicas}")
    if gpus is not None and not 0 <= gpus < float("inf"):
        raise StreamgrError(f"--gpus must be a number >= 0 (a replica's share), got {gpus}")
    args: dict[str, Any] = {"spec": spec, "overrides": dict(overrides or {}),
                            "replicas": replicas, "router": router}
    if gpus is not None:
        args["gpus"] = gpus
    return {"applications": [{"name": APP, "import_path": "streamgr.deploy.ray_serve:build_app",
                              "args": args}]}


_RETRY = None  # exception types that mean "the replica went away" (filled on first use)


def _gone() -> tuple:
    global _RETRY
    if _RETRY is None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
        _RETRY = (ActorDiedError, ActorUnavailableError, RayActorError)
    return _RETRY


class RayEngine:
    """An engine-shaped proxy over a running streamgr Serve application."""

    def __init__(self, spec, overrides: dict | None = None, replicas: int = 2,
                 router: str = "affinity", gpus: float | None = None, app: str = APP) -> None:
        from ..config import load_spec
        self.spec = load_spec(spec, overrides)
        self._args = (spec, overrides, replicas, router, gpus)
        self.app = app
        self.updates: list[dict] = []
        self.handle = None
        self._dead = None
        self.serves_rank = self.spec.model.family == "hstu"
        self.serves_generate = self.spec.generate_model is not None

    def start(self) -> "RayEngine":
        """Deploy the application (and its update log) and wait until its replicas serve."""
        spec, ov, n, router, gpus = self._args
        self.log = update_log(self.app)
        self.reports = Reports(self.log, REPORT_WAIT_S)
        self.handle = serve.run(deployment(spec, ov, n, router, gpus, app=self.app),
                                name=self.app, route_prefix=None)
        return self

    async def _call(self, method: str, user_id, request):
        for attempt in (0, 1):
            try:
                res, replica = await getattr(self.handle, method).remote(user_id, request)
                res.stats.replica = replica
                return res
            except _gone() as err:
                if attempt:
                    raise ReplicaUnavailable(f"the replica serving user {user_id!r} went away "
                                             f"({type(err).__name__}); retry") from None
                log.warning("replica lost during a %s request; retrying once", method)

    def submit_rank(self, request: RankRequest) -> asyncio.Future:
        return asyncio.ensure_future(self._call("rank", request.user_id, request))

    async def rank(self, request: RankRequest):
        return await self._call("rank", request.user_id, request)

    async def generate(self, request: GenerateRequest):
        return await self._call("generate", request.user_id, request)

    async def replica_stats(self) -> dict:
        return await self.handle.stats.remote()

    def stats(self) -> dict:
        """The application's, with ``replica_stats``: each live replica's engine stats as it
        last reported them (every ~0.2 s; read from the update log within
        ``REPORT_WAIT_S`` the first time, then without waiting, one read old at most: a
        monitoring call must not hold the event loop; ``update_log.Reports``)."""
        reports = self.reports.read()
        reports = None if reports is None else self._live(reports)
        return {"serves": [k for k, v in (("rank", self.serves_rank),
                                           ("generate", self.serves_generate)) if v],
                "ray_app": self.app, "replicas": self._args[2], "router": self._args[3],
                "updates": len(self.updates), "limits": self.spec.rank_limits,
                "replica_stats": None if reports is None else
                {r: rep["stats"] for r, rep in reports.items()}}

    async def versions(self) -> dict:
        """The updates applied through this driver, and each live replica's versions as it
        last reported them (every ~0.2 s, and with each update it applies or refuses)."""
        reports = self._live(await self.log.reports.remote())
        return {"updates": list(self.updates),
                "replicas": {r: rep["versions"] for r, rep in reports.items()}}

    def _live(self, reports: dict) -> dict:
        """``reports`` of the replicas alive now (a replaced one's last report is left out)."""
        live = self._replicas()
        return {r: rep for r, rep in sorted(reports.items())
                if any(r.endswith(rid) for rid in live)}

    def _replicas(self) -> list[str]:
        pre = f"SERVE_REPLICA::{self.app}#"
        return [a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(True)
                if a["name"].startswith(pre)]

    async def update(self, timeout: float = 600.0, **change) -> dict:
        """Log ``change`` (``Engine.update``'s arguments) for every replica and return once each
        live replica has applied it. The driver checks nothing itself: the replicas run the
        engine's checks, and a change they refused raises their error here (the type the
        embedded engine raises, e.g. ``ContractError``), while they keep serving their
        version; refused by some replicas only, a ``StreamgrError`` names both sides."""
        change = msgspec.to_builtins(change, str_keys=True)
        n = await self.log.append.remote(change)
        t_end = asyncio.get_running_loop().time() + timeout
        while True:
            _, acks = await self.log.state.remote()
            live = self._replicas()
            done = {rid: any(r.endswith(rid) and a >= n for r, a in acks.items()) for rid in live}
            if live and all(done.values()):
                break
            if asyncio.get_running_loop().time() > t_end:
                raise StreamgrError(f"update {n} not applied by every replica within {timeout} s "
                                    f"({sum(done.values())} of {len(live)})")
            await asyncio.sleep(0.1)
        refused = self._live(await self.log.refusals.remote(n))
        if refused:
            raise refusal(n, refused, [r for r in self._live(acks) if r not in refused])
        self.updates.append(change)
        return {**(await self.versions()), "acks": acks}

    async def rollback(self, target: str = "auto") -> dict:
        return await self.update(rollback=True, target=target)

    async def close(self, drain_timeout: float = 0.0) -> None:
        await asyncio.get_running_loop().run_in_executor(None, serve.delete, self.app)
        ray.kill(self.log)  # detached: it would outlive the application
