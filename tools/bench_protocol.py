"""Protocol benchmark: the socket path against the embedded call on rank-small.

- StatsRequest round trips per second over one pipelined connection (target: >= 20,000/s on the
  2-core CPU machine);
- rank requests/s and p50 latency embedded vs over the socket with 1, 8 and 64 connections, and
  the p50 the socket adds (target: <= 100 us);
- ``--ids``: alone, a rank request's host cost by history length, ids as lists against packed
  ids (numpy arrays sent as little-endian int64 bytes): the client's encoding, and the
  server's decode, unpacking and the engine's request check, which run on its event loop.

The server runs in its own process (as in production), on uvloop; the client on uvloop. Both
processes run torch with one thread and passive OpenMP waits: on two cores, spinning worker
threads of the side that just computed would otherwise steal the other side's core and the
difference would measure that, not the socket.

  python tools/bench_protocol.py [--requests 2000]
  python tools/bench_protocol.py --ids
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr import Engine, RankRequest  # noqa: E402
from streamgr.client import AsyncClient  # noqa: E402
from streamgr.protocol import messages as m  # noqa: E402

OVERRIDES = {"engine.device": "cpu", "engine.max_wait_ms": 0.0, "cache.mode": "recompute"}


def requests(n: int, seed: int = 0) -> list[RankRequest]:
    rng = np.random.default_rng(seed)
    return [RankRequest(user_id=int(i), items=rng.integers(1000, size=16).tolist(),
                        actions=rng.integers(16, size=16).tolist(),
                        candidates=rng.choice(1000, 16, replace=False).tolist()) for i in range(n)]


async def closed_loop(call, reqs, conc: int) -> tuple[float, np.ndarray]:
    lat: list[float] = []
    it = iter(reqs)

    async def worker(i):
        for r in it:
            t = time.perf_counter()
            await call(i, r)
            lat.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(conc)))
    return len(reqs) / (time.perf_counter() - t0), np.array(lat) * 1e6


async def embedded(reqs, conc):
    async with Engine.from_spec("rank-small", OVERRIDES) as e:
        await closed_loop(lambda i, r: e.rank(r), reqs[:200], conc)  # warm-up
        return await closed_loop(lambda i, r: e.rank(r), reqs, conc)


async def socket_path(addr, reqs, conns, conc):
    clients = [await AsyncClient(addr).connect() for _ in range(conns)]
    await closed_loop(lambda i, r: clients[i % conns].rank(r), reqs[:200], conc)
    out = await closed_loop(lambda i, r: clients[i % conns].rank(r), reqs, conc)
    for c in clients:
        await c.close()
    return out


async def _pairs(engine, client, reqs) -> tuple[float, float, float]:
    """One embedded call, then the same request over the socket, alternating: drift and noise
    hit both sides alike. Returns (embedded p50, socket p50, median of pair differences), us."""
    for r in reqs[:200]:  # warm-up
        await engine.rank(r)
        await client.rank(r)
    emb, sock = [], []
    for r in reqs:
        t = time.perf_counter()
        await engine.rank(r)
        t1 = time.perf_counter()
        await client.rank(r)
        emb.append(t1 - t)
        sock.append(time.perf_counter() - t1)
    emb, sock = np.array(emb) * 1e6, np.array(sock) * 1e6
    return float(np.median(emb)), float(np.median(sock)), float(np.median(sock - emb))


async def interleaved(addr, reqs) -> tuple[float, float, float]:
    """Pairs against the server process at ``addr``."""
    async with Engine.from_spec("rank-small", OVERRIDES) as e:
        async with AsyncClient(addr) as c:
            return await _pairs(e, c, reqs)


async def same_process(reqs) -> tuple[float, float, float]:
    """Pairs with the server on this process's loop: the protocol stack's own cost (client,
    loopback socket, server), without a second process to wake."""
    from streamgr.server import Server
    async with Engine.from_spec("rank-small", OVERRIDES) as e:
        srv = Server(e)
        addr = (await srv.start("127.0.0.1", 0))[0]
        try:
            async with AsyncClient(addr) as c:
                return await _pairs(e, c, reqs)
        finally:
            await srv.shutdown(1.0)


async def stats_rate(addr, n: int) -> float:
    c = await AsyncClient(addr).connect()
    window = 256  # requests kept in flight on the one connection

    async def one():
        await c._call(lambda rid: m.StatsRequest(rid), None)
    t0 = time.perf_counter()
    for i in range(0, n, window):
        await asyncio.gather(*(one() for _ in range(min(window, n - i))))
    rate = n / (time.perf_counter() - t0)
    await c.close()
    return rate


def ids_costs(lengths=(16, 512, 3500), reps: int = 300) -> list[tuple]:
    """(events, form, client encode us, server us, frame bytes) per history length, the form
    ``list`` or ``packed``: the server's part is what its loop does before the batcher (frame
    decode, ``server.unpacked``, ``engine.rank.prepare_rank``)."""
    from streamgr import api
    from streamgr.protocol.ids import wire_ids as _ids
    from streamgr.engine.rank import prepare_rank
    from streamgr.models.hstu import HSTUConfig
    from streamgr.protocol import Codec
    from streamgr.server.server import unpacked
    cfg = HSTUConfig(num_layers=1, model_dim=8, num_heads=1, head_dim=8, num_items=1_000_000,
                     num_actions=16, max_history=max(lengths), max_candidates=256)
    codec, rng, out = Codec(), np.random.default_rng(0), []
    for n in lengths:
        items, actions = rng.integers(1_000_000, size=n), rng.integers(16, size=n)
        cands = rng.choice(1_000_000, 64, replace=False)
        for form, packed, conv in (("list", False, lambda a: a.tolist()),
                                   ("packed", True, lambda a: a)):
            r = api.RankRequest(user_id=1, items=conv(items), actions=conv(actions),
                                candidates=conv(cands))

            def encode():
                return codec.frame(m.RankRequest(1, r.user_id, _ids(r.items, packed),
                                                 _ids(r.actions, packed),
                                                 _ids(r.candidates, packed)))

            def serve(body):
                msg = codec.decode(body)
                prepare_rank(api.RankRequest(
                    user_id=msg.user_id, items=unpacked(msg.items, "items"),
                    actions=unpacked(msg.actions, "actions"),
                    candidates=unpacked(msg.candidates, "candidates")), cfg)
            body = encode()[4:]
            for _ in range(20):
                encode(), serve(body)
            t = time.perf_counter()
            for _ in range(reps):
                encode()
            t1 = time.perf_counter()
            for _ in range(reps):
                serve(body)
            t2 = time.perf_counter()
            out.append((n, form, (t1 - t) / reps * 1e6, (t2 - t1) / reps * 1e6, len(body)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--stats", type=int, default=40000)
    ap.add_argument("--ids", action="store_true", help="only the ids' host costs (no server)")
    args = ap.parse_args()
    if args.ids:
        print(f"{'events':>6}  {'ids':>6}  {'client encode us':>16}  {'server us':>9}  "
              f"{'frame bytes':>11}")
        rows = ids_costs()
        for n, form, enc, srv, size in rows:
            print(f"{n:>6}  {form:>6}  {enc:>16.1f}  {srv:>9.1f}  {size:>11}")
        by = {(n, f): s for n, f, _, s, _ in rows}
        n = max(n for n, _, _, _, _ in rows)
        print(f"bench_protocol --ids: {n} events, server {by[n, 'list']:.0f} us with lists, "
              f"{by[n, 'packed']:.0f} us packed")
        return 0
    import os

    import torch
    import uvloop
    torch.set_num_threads(1)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-m", "streamgr", "serve", "rank-small", "--port", "0",
                             "--loop", "uvloop"] + [a for k, v in OVERRIDES.items()
                                                    for a in ("--set", f"{k}={v}")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        addr = "127.0.0.1:" + re.search(r"127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1)
        reqs = requests(args.requests)
        rows = []
        srate = uvloop.run(stats_rate(addr, args.stats))
        pair = uvloop.run(interleaved(addr, reqs))
        same = uvloop.run(same_process(reqs))
        for conns in (1, 8, 64):
            e_rps, e_lat = uvloop.run(embedded(reqs, conns))
            s_rps, s_lat = uvloop.run(socket_path(addr, reqs, conns, conns))
            rows.append((conns, e_rps, np.percentile(e_lat, 50), s_rps, np.percentile(s_lat, 50)))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print("rank-small recompute, closed loop, concurrency = connections")
    print(f"{'conns':>5}  {'embedded req/s':>14}  {'emb p50 us':>10}  {'socket req/s':>12}  "
          f"{'sock p50 us':>11}  {'added p50 us':>12}")
    for c, er, ep, sr, sp in rows:
        print(f"{c:>5}  {er:>14.0f}  {ep:>10.0f}  {sr:>12.0f}  {sp:>11.0f}  {sp - ep:>12.0f}")
    print(f"interleaved, 1 connection: embedded p50 {pair[0]:.0f} us, socket p50 {pair[1]:.0f} us, "
          f"median per-pair difference {pair[2]:.0f} us")
    print(f"interleaved, server in this process: embedded p50 {same[0]:.0f} us, socket p50 "
          f"{same[1]:.0f} us, median per-pair difference {same[2]:.0f} us")
    print(f"stats round trips over one pipelined connection: {srate:,.0f}/s (target >= 20,000/s)")
    print(f"bench_protocol: stats {srate:,.0f}/s; socket adds {pair[1] - pair[0]:.0f} us p50 to a "
          f"rank call across processes, {same[1] - same[0]:.0f} us within one (target <= 100 us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
