"""``streamgr status --server ADDR``: a served engine's health and stats summary, exit 0 when
ready, 1 when it answers but is not ready, 2 when nothing answers (a real server on loopback)."""

from __future__ import annotations

import json
import re
import socket

from streamgr import RankRequest
from streamgr.cli import main
from streamgr.client import Client
from tests.protocol.helpers import ServerThread


def test_status_summarizes_a_served_engine_and_exits_by_readiness(capsys):
    with ServerThread("uvloop") as srv:
        with Client(srv.addr) as c:
            for u in range(6):
                c.rank(RankRequest(user_id=u % 3, items=[1, 2, 3], actions=[0, 1, 2],
                                   candidates=[4, 5]))
        assert main(["status", "--server", srv.addr]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"{srv.addr}: ready (serves rank on cpu, 1 connection)"), text
        assert "requests: rank ok 6" in text and "versions: rank 1:seed:0" in text
        assert re.search(r"^rank latency ms \(last 6\): mean [\d.]+, p50", text, re.M), text
        assert "engine: 0 queued, 0 in flight" in text
        assert re.search(r"^cache \(\w+\): hits GPU [\d.]+%, total", text, re.M), text

        assert main(["status", "--server", srv.addr, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["health"] == {"live": True, "ready": True, "status": "ready"}
        assert out["stats"]["counters"]["rank_requests"] == 6

        srv.engine._dead = RuntimeError("a CUDA fault")  # live, answering, not ready
        try:
            assert main(["status", "--server", srv.addr]) == 1
            assert capsys.readouterr().out.startswith(f"{srv.addr}: engine dead")
        finally:
            srv.engine._dead = None
        srv.server.closing = True  # draining: new connections are refused with OVERLOADED
        try:
            assert main(["status", "--server", srv.addr]) == 1
            assert capsys.readouterr().out == f"{srv.addr}: not ready: server is shutting down\n"
        finally:
            srv.server.closing = False
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert main(["status", "--server", f"127.0.0.1:{free}", "--timeout", "2"]) == 2
    assert "no streamgr server answers" in capsys.readouterr().err


def test_status_lines_name_only_the_versions_served():
    """A generate engine reports a ``weights_version`` too; only what it serves is named."""
    from streamgr.admin_cli import status_lines
    from streamgr.protocol import messages as m
    stats = {"serves": ["generate"], "device": "cpu", "weights_version": "g1",
             "generate_version": "g1", "server": {"connections": 2,
                                                  "requests": {"generate:ok": 5}},
             "generate_latency_ms": {"mean": 1.0, "p50": 1.0, "p99": 2.0, "window": 5},
             "queued": 0, "inflight": 1}
    lines = status_lines("h:1", m.HealthReply(1, True, True, "ready"), stats)
    assert lines == ["h:1: ready (serves generate on cpu, 2 connections)",
                     "versions: generate g1", "requests: generate ok 5",
                     "generate latency ms (last 5): mean 1.00, p50 1.00, p99 2.00",
                     "engine: 0 queued, 1 in flight"]


def test_status_lines_of_a_ray_application_name_each_replica():
    """Against a ``--ray`` server the summary says the application and, per replica, what its
    engine last reported (before: "on ?" and nothing of the replicas' caches or versions)."""
    from streamgr.admin_cli import status_lines
    from streamgr.protocol import messages as m
    replica = {"serves": ["rank"], "device": "cuda:0", "weights_version": "2:seed:99",
               "total_hit_ratio": 0.5, "gpu_hit_ratio": 0.25, "held_ratio": 0.5,
               "cache_mode": "hierarchical", "queued": 3, "inflight": 8,
               "cache": {"resident_users": 1200, "free_pages": 10, "free_chunks": 7}}
    stats = {"serves": ["rank"], "ray_app": "streamgr", "replicas": 2, "router": "affinity",
             "server": {"connections": 1, "requests": {"rank:ok": 9}},
             "replica_stats": {"0:abc": replica, "1:def": {**replica, "queued": 0}}}
    lines = status_lines("h:1", m.HealthReply(1, True, True, "ready"), stats)
    assert lines == [
        "h:1: ready (serves rank on Ray app streamgr, 2 replicas, 1 connection)",
        "requests: rank ok 9",
        "replica 0:abc on cuda:0:",
        "  versions: rank 2:seed:99",
        "  engine: 3 queued, 8 in flight",
        "  cache (hierarchical): hits GPU 25.0%, total 50.0%, held 50.0%; 1,200 users resident, "
        "10 free pages, 7 free host chunks",
        "replica 1:def on cuda:0:",
        "  versions: rank 2:seed:99",
        "  engine: 0 queued, 8 in flight",
        "  cache (hierarchical): hits GPU 25.0%, total 50.0%, held 50.0%; 1,200 users resident, "
        "10 free pages, 7 free host chunks"]
    stats["replica_stats"] = None  # the update log did not answer in time
    assert status_lines("h:1", m.HealthReply(1, True, True, "ready"), stats)[-1] == \
        "replicas: their stats are not available now (the update log actor)"
