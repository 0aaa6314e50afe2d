"""The Prometheus text of ``ServerMetrics``: saturation and token counters for an engine of the
server's own process (a generate one too), none for a Ray ingress, whose replicas keep them."""

from __future__ import annotations

import re

from streamgr.server.metrics import ServerMetrics


def _engine_stats(serves):
    return {"serves": serves, "queued": 4, "inflight": 9,
            "counters": {"rank_batches": 7, "rank_requests": 40, "generate_batches": 3,
                         "generate_requests": 12, "generate_gpu_us": 2_500_000,
                         "tokens_from_gpu": 100, "tokens_from_host": 20, "tokens_recomputed": 5,
                         "tokens_host_recomputed": 2}}


def _values(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def test_an_engines_batches_queue_and_history_tokens():
    v = _values(ServerMetrics().prometheus(_engine_stats(["rank", "generate"]), 2, 9))
    assert v["streamgr_engine_queued"] == 4
    assert v['streamgr_batches_total{kind="rank"}'] == 7
    assert v['streamgr_batched_requests_total{kind="rank"}'] == 40
    assert v['streamgr_batches_total{kind="generate"}'] == 3
    assert v['streamgr_batched_requests_total{kind="generate"}'] == 12
    assert v['streamgr_rank_history_tokens_total{source="gpu"}'] == 100
    assert v['streamgr_rank_history_tokens_total{source="host"}'] == 20
    assert v['streamgr_rank_history_tokens_total{source="recomputed"}'] == 5
    assert v["streamgr_generate_gpu_seconds_total"] == 2.5


def test_a_rank_engine_has_no_generate_lines_and_each_type_is_declared_once():
    text = ServerMetrics().prometheus(_engine_stats(["rank"]), 0, 0)
    assert 'kind="generate"' not in text and "generate_gpu" not in text
    types = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(types) == len(set(types)), types
    for name in ("streamgr_batches_total", "streamgr_batched_requests_total",
                 "streamgr_rank_history_tokens_total", "streamgr_engine_queued"):
        assert name in types


def test_a_ray_ingress_reports_no_engine_counters():
    """Its stats name what the app serves but hold no counters: zeros would read as idle."""
    text = ServerMetrics().prometheus({"serves": ["rank"], "ray_app": "a", "replicas": 2}, 1, 0)
    assert "streamgr_batches_total" not in text and "streamgr_engine_queued" not in text
    assert "streamgr_rank_history_tokens_total" not in text
