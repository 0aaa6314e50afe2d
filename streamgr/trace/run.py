"""``streamgr trace replay``: a trace through the embedded engine or a server.

Each request carries the user's full history so far (the trace holds only the new events).
Against the embedded engine: ``batch`` runs MTServe's offline replay (batches of distinct users
in trace order, with the per-stage breakdown); otherwise requests go through the async engine
closed-loop (``concurrency`` in flight) or open-loop (Poisson ``rate``). Against a server the
same, over the socket. Results: a JSON-lines file with one ``run`` line per mode (the summary)
and one ``request`` line per request (latency, stages, tier, tokens).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time

import msgspec
import numpy as np

from ..api import RankRequest
from ..config import RANK_LIMITS
from ..errors import StreamgrError
from ..progress import Progress
from .format import WholeFile, check_output, read_header
from .replay import batches_of_distinct_users, replay_batches
from .requests import ReplayError, load_generate_requests, load_requests

MODES = ("recompute", "gpu-only", "hierarchical")


def _record(mode: str, i: int, latency_ms: float, stats) -> dict:
    s = stats if isinstance(stats, dict) else msgspec.to_builtins(stats)
    return {"type": "request", "mode": mode, "index": i, "latency_ms": float(latency_ms),
            "tier": s.get("tier", ""), "history_tokens": s.get("history_tokens", 0),
            "from_gpu": s.get("tokens_from_gpu", 0), "from_host": s.get("tokens_from_host", 0),
            "recomputed": s.get("tokens_recomputed", 0),
            "host_recomputed": s.get("tokens_host_recomputed", 0),
            "batch_size": s.get("batch_size", 0),
            "queue_ms": s.get("queue_ms", 0.0), "compute_ms": s.get("compute_ms", 0.0),
            "stages": s.get("stages", s.get("steps", {}))}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a replay: the results so far were written (``path``)."""

    def __init__(self, path, answered: int) -> None:
        super().__init__(f"interrupted: {answered} answered requests written to {path}")
        self.path, self.answered = path, answered


async def drive(call, reqs: list, concurrency: int, rate: float | None, label: str,
                progress: bool, mode: str, sink: dict | None = None
                ) -> tuple[list[dict], float, list[dict]]:
    """Requests through ``call`` closed-loop (``concurrency`` in flight) or open-loop (Poisson
    arrivals at ``rate``/s; a latency counts from the arrival, so loop lag is not hidden).
    Returns the records of answered requests, the wall time, and one record per failure;
    ``sink`` (a dict) sees the same lists as they fill, so an interrupted replay keeps them."""
    records: list[dict] = []
    errors: list[dict] = []
    if sink is not None:
        sink.update(records=records, errors=errors, t0=time.perf_counter())
    if progress:
        how = (f"open loop at {rate:g}/s: about {len(reqs) / rate:.0f} s" if rate else
               f"closed loop, {concurrency} in flight")
        print(f"{label}: {len(reqs):,} requests, {how}", file=sys.stderr, flush=True)
    rng = np.random.default_rng(1)
    with Progress(len(reqs), label, enabled=progress) as bar:
        t0 = time.perf_counter()

        async def one(i: int, r, t: float | None = None):
            t = time.perf_counter() if t is None else t
            try:
                res = await call(r)
            except (StreamgrError, OSError, asyncio.TimeoutError) as err:
                errors.append({"type": "error", "mode": mode, "index": i,
                               "code": getattr(err, "code", type(err).__name__),
                               "message": str(err)})
            else:
                records.append(_record(mode, i, (time.perf_counter() - t) * 1e3, res.stats))
            bar.update()

        if rate:
            arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(reqs)))
            tasks = []
            for i, r in enumerate(reqs):
                delay = t0 + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(i, r, t0 + arrivals[i])))
            await asyncio.gather(*tasks)
        else:
            it = iter(enumerate(reqs))

            async def worker():
                for i, r in it:
                    await one(i, r)
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    records.sort(key=lambda x: x["index"])
    return records, wall, errors


def summarize(mode: str, records: list[dict], wall: float, errors: list[dict],
              extra: dict) -> dict:
    lat = np.array([r["latency_ms"] for r in records]) if records else np.zeros(1)
    hist = sum(r["history_tokens"] for r in records)
    gpu = sum(r["from_gpu"] for r in records)
    host = sum(r["from_host"] for r in records)
    held = gpu + host + sum(r.get("host_recomputed", 0) for r in records)
    stages: dict[str, float] = {}
    for r in records:
        for k, v in r["stages"].items():
            stages[k] = stages.get(k, 0.0) + v / len(records)
    codes: dict[str, int] = {}
    for e in errors:
        codes[e["code"]] = codes.get(e["code"], 0) + 1
    return {"type": "run", "mode": mode, "requests": len(records), "errors": len(errors),
            "error_codes": codes, "first_error": errors[0]["message"] if errors else None,
            "mean_ms": float(lat.mean()), "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "throughput": len(records) / max(wall, 1e-9),
            "gpu_hit_ratio": gpu / hist if hist else 0.0,
            "total_hit_ratio": (gpu + host) / hist if hist else 0.0,
            "held_ratio": held / hist if hist else 0.0, "stages_ms": stages, **extra}


def _check_load(batch, rate, concurrency, limit, candidates) -> None:
    """The load options, before any request (0 would read as "unset" where they are tested
    for truth)."""
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ReplayError(f"--rate must be a finite number > 0 (requests/s), got {rate}")
    for flag, value in (("--concurrency", concurrency), ("--batch", batch), ("--limit", limit),
                        ("--candidates", candidates)):
        if value is not None and value < 1:
            raise ReplayError(f"{flag} must be at least 1, got {value}")


def replay_trace(trace, out, spec=None, overrides=None, server: str | None = None,
                 batch: int | None = None, rate: float | None = None, concurrency: int = 8,
                 compare_modes: bool = False, limit: int | None = None, fold_ids: bool = False,
                 candidates: int = 32, progress: bool = True, token: str | None = None) -> list[dict]:
    from ..config import load_spec
    from ..engine import Engine
    _check_load(batch, rate, concurrency, limit, candidates)
    check_output(out)
    kind = read_header(trace).kind
    if server is not None:
        ignored = [f for f, on in (("--batch", batch), ("--compare-modes", compare_modes),
                                   ("--fold-ids", fold_ids and kind == "generate"),
                                   ("--set", overrides)) if on]
        if ignored:  # each needs the engine in this process (a generate trace's catalog too)
            raise ReplayError(f"{', '.join(ignored)} cannot apply to a {kind} replay against a "
                              f"server (--server {server}); replay with --spec instead")
    sp = load_spec(spec, overrides) if spec is not None else None
    if kind == "generate":
        return _replay_generate(trace, out, sp, server, rate, concurrency, compare_modes, batch,
                                limit, fold_ids, progress, token)
    if sp is not None and sp.model.family != "hstu":  # before a run of failed requests
        raise ReplayError(f"spec {sp.name} serves no rank model; the trace is rank")
    lim = sp.rank_limits if sp is not None else None
    if server is not None and fold_ids:  # the folds need the served model's tables
        lim = _server_limits(server, token)
    reqs, skipped = load_requests(trace, lim and lim["num_items"], lim and lim["num_actions"],
                                  lim and lim["max_history"], fold_ids,
                                  min(candidates, lim["max_candidates"]) if lim else candidates,
                                  limit)
    if not reqs:
        raise ReplayError(f"{trace}: no request to replay ({skipped} over the model's max history)")
    modes = MODES if compare_modes else ((sp.cache.mode,) if sp is not None else ("server",))
    rank_requests = [RankRequest(user_id=r.user, items=r.items, actions=r.actions,
                                 candidates=r.candidates) for r in reqs]
    runs: list[dict] = []
    lines: list[dict] = []
    for mode in modes:
        extra = {"trace": str(trace), "spec": sp.name if sp else None, "server": server,
                 "skipped_over_max_history": skipped}
        sink: dict = {}
        if server is not None:
            from ..client import AsyncClient

            async def go():
                async with AsyncClient(server, token=token) as c:
                    extra["device"] = (await c.stats()).get("device")
                    return await drive(c.rank, rank_requests, concurrency, rate,
                                        f"replay {server}", progress, mode, sink)
            records, wall, errors = _run(go, out, lines, mode, extra, sink)
        elif batch:
            eng = Engine(load_spec(sp, {"cache.mode": mode}))
            groups = list(batches_of_distinct_users(((r, r.items, r.actions) for r in reqs),
                                                    batch))
            res = replay_batches(eng, groups, label=f"replay {mode} bs={batch}", progress=progress)
            eng.close_offline()
            extra["device"] = str(eng.device)
            # the latency of a request here is its batch's: the report groups by "batch"
            records = [{**_record(mode, rec.index, rec.latency_ms, {
                "tier": rec.tier, "history_tokens": rec.history_tokens,
                "tokens_from_gpu": rec.from_gpu, "tokens_from_host": rec.from_host,
                "tokens_recomputed": rec.recomputed,
                "tokens_host_recomputed": rec.host_recomputed, "stages": {}}), "batch": rec.batch}
                for rec in res.records]
            per_batch = {k: v / max(res.batches, 1) for k, v in res.stages.items()}
            for r in records:
                r["stages"] = per_batch
            wall, errors = res.wall_s, []
        else:
            async def go():
                async with Engine.from_spec(sp, {"cache.mode": mode}) as eng:
                    extra["device"] = str(eng.device)
                    return await drive(eng.rank, rank_requests, concurrency, rate,
                                        f"replay {mode}", progress, mode, sink)
            records, wall, errors = _run(go, out, lines, mode, extra, sink)
        run = summarize(mode, records, wall, errors, extra)
        runs.append(run)
        lines += [run, *records, *errors]
    _write_results(out, lines)
    return runs


def _server_limits(server: str, token: str | None) -> dict:
    """The served rank model's limits from its ``stats()`` (``Spec.rank_limits``)."""
    from ..client import AsyncClient

    async def go():
        async with AsyncClient(server, token=token) as c:
            return await c.stats()
    stats = asyncio.run(go())
    lim = stats.get("limits")
    if "rank" not in stats.get("serves", ["rank"]) or not isinstance(lim, dict) \
            or not all(isinstance(lim.get(k), int) for k in RANK_LIMITS):
        raise ReplayError(f"the server at {server} reports no rank model's limits in its stats "
                          f"(it serves no rank model, or predates them): --fold-ids needs them "
                          f"to fold the trace's ids")
    return lim


def _run(go, out, lines: list[dict], mode: str, extra: dict, sink: dict):
    """``asyncio.run(go())``; on Ctrl-C, the runs so far plus this one's answered requests are
    written to ``out`` (its summary marked ``interrupted``) before ``Interrupted`` is raised."""
    try:
        return asyncio.run(go())
    except KeyboardInterrupt:
        records = sorted(sink.get("records", []), key=lambda x: x["index"])
        errors = sink.get("errors", [])
        wall = time.perf_counter() - sink.get("t0", time.perf_counter())
        run = summarize(mode, records, wall, errors, {**extra, "interrupted": True})
        _write_results(out, [*lines, run, *records, *errors])
        raise Interrupted(out, len(records)) from None


def _numpy_scalar(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a results line")


def _write_results(out, lines: list[dict]) -> None:
    """All of the results or none (``WholeFile``)."""
    with WholeFile(out) as f:
        enc = msgspec.json.Encoder(enc_hook=_numpy_scalar)
        for line in lines:
            f.write(enc.encode(line) + b"\n")


def _replay_generate(trace, out, sp, server, rate, concurrency, compare_modes, batch, limit,
                     fold_ids, progress, token=None) -> list[dict]:
    from ..engine import Engine
    if compare_modes or batch:
        raise ReplayError("--compare-modes and --batch replay rank traces; this one is generate")
    engine = Engine(sp) if sp is not None else None
    if engine is not None and not engine.serves_generate:
        raise ReplayError(f"spec {sp.name} serves no generate model; the trace is generate")
    ids = engine.gen_runner.trie.leaf_items if engine is not None else None
    reqs = load_generate_requests(trace, ids, fold_ids, limit)
    sink: dict = {}
    extra = {"trace": str(trace), "server": server, "spec": sp.name if sp else None,
             "skipped_over_max_history": 0}
    if server is not None:
        from ..client import AsyncClient

        async def go():
            async with AsyncClient(server, token=token) as c:
                extra["device"] = (await c.stats()).get("device")
                return await drive(c.generate, reqs, concurrency, rate, f"replay {server}",
                                    progress, "generate", sink)
    else:
        extra["device"] = str(engine.device)

        async def go():
            async with engine:
                return await drive(engine.generate, reqs, concurrency, rate, "replay generate",
                                    progress, "generate", sink)
    records, wall, errors = _run(go, out, [], "generate", extra, sink)
    run = summarize("generate", records, wall, errors, extra)
    _write_results(out, [run, *records, *errors])
    return [run]


def format_runs(runs: list[dict]) -> str:
    head = ("mode", "requests", "errors", "mean ms", "p50 ms", "p99 ms", "req/s", "GPU hit",
            "total hit")
    rows = [(r["mode"], str(r["requests"]), str(r.get("errors", 0)), f"{r['mean_ms']:.2f}", f"{r['p50_ms']:.2f}",
             f"{r['p99_ms']:.2f}", f"{r['throughput']:.1f}", f"{100 * r['gpu_hit_ratio']:.2f}%",
             f"{100 * r['total_hit_ratio']:.2f}%") for r in runs]
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(n) for c, n in zip(cells, w))  # noqa: E731
    lines = [fmt(head), fmt(["-" * n for n in w]), *map(fmt, rows)]
    stage_names = sorted({k for r in runs for k in r["stages_ms"]})
    if stage_names:
        lines.append("stage breakdown, mean ms: " + "; ".join(
            f"{r['mode']}: " + ", ".join(f"{k} {r['stages_ms'].get(k, 0):.2f}" for k in stage_names)
            for r in runs))
    base = next((r for r in runs if r["mode"] == "recompute"), None)
    if base and len(runs) > 1:
        lines.append("speed-up vs recompute (mean latency): " + ", ".join(
            f"{r['mode']} {base['mean_ms'] / r['mean_ms']:.2f}x" for r in runs))
    for r in runs:
        if r.get("errors"):
            lines.append(f"{r['mode']}: {r['errors']} requests failed "
                         f"({', '.join(f'{k} x{v}' for k, v in r['error_codes'].items())}); "
                         f"first: {r['first_error']}")
    if runs and runs[0].get("skipped_over_max_history"):
        lines.append(f"{runs[0]['skipped_over_max_history']} requests skipped: history over the "
                     f"model's max_history (raise it with --set model.max_history=N)")
    return "\n".join(lines)
