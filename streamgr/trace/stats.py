"""``streamgr trace stats``: what a trace asks of a deployment.

Users, requests, history lengths, events per request, revisit intervals, and the working set:
the K/V every user's final history needs, in tokens and bytes for a spec's model, against the
spec's device pages and host chunks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .format import read_header, read_trace


def _dist(x) -> dict:
    a = np.asarray(x, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "min": float(a.min()), "mean": float(a.mean()),
            "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def trace_stats(path: str | Path, spec=None) -> dict:
    header = read_header(path)
    lengths: dict = {}
    last_t: dict = {}
    per_req, gaps = [], []
    max_item = max_action = -1
    n = 0
    for r in read_trace(path):
        n += 1
        lengths[r.user] = lengths.get(r.user, 0) + len(r.items)
        per_req.append(len(r.items))
        if r.user in last_t:
            gaps.append(r.time - last_t[r.user])
        last_t[r.user] = r.time
        if r.items:
            max_item = max(max_item, max(r.items))
        acts = getattr(r, "actions", None)
        if acts:
            max_action = max(max_action, max(acts))
    hist = list(lengths.values())
    tokens = 2 * sum(hist) if header.kind == "rank" else sum(hist)
    out = {"trace": str(path), "kind": header.kind, "source": header.source, "users": len(lengths),
           "requests": n, "history_events": _dist(hist), "events_per_request": _dist(per_req),
           "revisit_interval_s": _dist(gaps), "max_item_id": max_item, "max_action": max_action,
           "working_set_tokens": tokens}
    if spec is not None and header.kind == "rank":
        m, c = spec.model, spec.cache
        bytes_per = 2 if m.dtype in ("auto", "bfloat16", "float16") else 4
        per_token = m.num_layers * 2 * m.num_heads * m.head_dim * bytes_per
        out.update(
            kv_bytes_per_token=per_token, working_set_bytes=tokens * per_token,
            device_cache_tokens=c.device_pages * c.page_tokens,
            host_cache_tokens=c.host_chunks * c.chunk_tokens,
            device_fraction_of_working_set=(c.device_pages * c.page_tokens) / max(tokens, 1),
            fits_embedding_tables=max_item < m.num_items and max_action < m.num_actions,
            users_over_max_history=sum(1 for h in hist if h > m.max_history))
    return out


def format_stats(s: dict) -> str:
    def d(name, x):
        if not x.get("n"):
            return f"{name:<24} -"
        return (f"{name:<24} mean {x['mean']:.1f}  p50 {x['p50']:.0f}  p90 {x['p90']:.0f}  "
                f"p99 {x['p99']:.0f}  max {x['max']:.0f}")
    lines = [f"trace {s['trace']} ({s['kind']}, {s['source']})",
             f"{'users':<24} {s['users']:,}", f"{'requests':<24} {s['requests']:,}",
             d("history (events/user)", s["history_events"]),
             d("events per request", s["events_per_request"]),
             d("revisit interval (s)", s["revisit_interval_s"]),
             f"{'max item id / action':<24} {s['max_item_id']} / {s['max_action']}",
             f"{'working set (tokens)':<24} {s['working_set_tokens']:,}"]
    if "working_set_bytes" in s:
        lines += [f"{'working set (bytes)':<24} {s['working_set_bytes'] / 2**30:,.2f} GiB "
                  f"({s['kv_bytes_per_token']:,} B/token)",
                  f"{'device cache':<24} {s['device_cache_tokens']:,} tokens = "
                  f"{100 * s['device_fraction_of_working_set']:.1f}% of the working set",
                  f"{'host cache':<24} {s['host_cache_tokens']:,} tokens",
                  f"{'fits the tables':<24} {s['fits_embedding_tables']} "
                  f"(else replay needs --fold-ids)",
                  f"{'users over max history':<24} {s['users_over_max_history']}"]
    return "\n".join(lines)
