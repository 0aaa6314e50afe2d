"""``streamgr trace report``: PNG plots and a markdown summary of replay results.

Plots: latency CDF per mode; for rank runs the total hit ratio over the replay and mean latency
by tier (GPU hit, host hit, miss: in ``--batch`` results, over the batches that contain a request
of the tier, each batch once); for generate runs latency over the replay and queue vs compute
time; the stage breakdown stacked per mode (its parts, never a total). Every plot names the
trace, spec (or server) and device it came from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from ..errors import StreamgrError

log = logging.getLogger("streamgr.trace")


def load_results(paths) -> list[tuple[str, dict, list[dict]]]:
    """[(label, run summary, request records)] of every run in the results files."""
    out = []
    for p in map(Path, paths):
        runs: dict[str, dict] = {}
        reqs: dict[str, list] = {}
        with open(p) as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    if not line.endswith("\n") and runs:  # the last line, cut short (a
                        # replay killed or a disk filled while it wrote): the rest stands
                        log.warning("%s:%d: the last line is cut short; reporting the %d "
                                    "lines before it", p, n, n - 1)
                        break
                    raise ValueError(f"{p}:{n}: not a results line: {err}") from None
                if rec.get("type") == "run":
                    runs[rec["mode"]] = rec
                elif rec.get("type") == "request":
                    reqs.setdefault(rec["mode"], []).append(rec)
        if not runs:
            raise ValueError(f"{p}: no run in this file (not `streamgr trace replay` output?)")
        for mode, run in runs.items():
            label = mode if len(paths) == 1 else f"{p.stem}:{mode}"
            out.append((label, run, reqs.get(mode, [])))
    return out


def write_report(paths, out_dir) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        raise StreamgrError("trace report draws its plots with matplotlib, which is not "
                            "installed: pip install 'streamgr[trace]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_results(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    generate = all(run.get("mode") == "generate" for _, run, _ in runs)
    origin = "; ".join(sorted({
        f"{Path(str(run.get('trace', '?'))).name}, "
        f"{'spec ' + str(run['spec']) if run.get('spec') else 'server ' + str(run.get('server'))}"
        f", {run.get('device') or 'device ?'}" for _, run, _ in runs}))

    def save(fig, name):
        fig.suptitle(origin, fontsize=8, y=0.995)
        files.append(_save(fig, out / name))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, _, reqs in runs:
        lat = np.sort([r["latency_ms"] for r in reqs])
        if lat.size:
            ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=label)
    ax.set(xlabel="latency (ms)", ylabel="fraction of requests", title="Latency CDF",
           xscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "latency_cdf.png")

    if generate:
        _generate_plots(plt, runs, save)
    else:
        _rank_plots(plt, runs, save)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    stages = sorted({k for _, run, _ in runs for k in run.get("stages_ms", {})} - {"total"})
    bottom = np.zeros(len(runs))
    for st in stages:
        vals = np.array([run.get("stages_ms", {}).get(st, 0.0) for _, run, _ in runs])
        ax.bar([lab for lab, _, _ in runs], vals, bottom=bottom, label=st)
        bottom += vals
    ax.set(ylabel="ms", title="Stage breakdown (per batch, mean)")
    if stages:
        ax.legend(fontsize=8)
    save(fig, "stages.png")

    lines = ["# Replay report", "", origin, "",
             "| run | requests | errors | mean ms | p50 ms | p99 ms | req/s | GPU hit | total hit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, run, _ in runs:
        lines.append(f"| {label} | {run['requests']} | {run.get('errors', 0)} | "
                     f"{run['mean_ms']:.2f} | {run['p50_ms']:.2f} | {run['p99_ms']:.2f} | "
                     f"{run['throughput']:.1f} | {100 * run['gpu_hit_ratio']:.2f}% | "
                     f"{100 * run['total_hit_ratio']:.2f}% |")
    lines += [""] + [f"![{f.stem}]({f.name})" for f in files]
    summary = out / "summary.md"
    summary.write_text("\n".join(lines) + "\n")
    return files + [summary]


def _rank_plots(plt, runs, save) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, _, reqs in runs:
        hist = np.cumsum([r["history_tokens"] for r in reqs])
        hit = np.cumsum([r["from_gpu"] + r["from_host"] for r in reqs])
        if hist.size and hist[-1]:
            ax.plot(np.arange(1, hist.size + 1), hit / np.maximum(hist, 1), label=label)
    ax.set(xlabel="request", ylabel="total hit ratio (cumulative)", title="Hit ratio over time",
           ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "hit_ratio.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    tiers = ("gpu", "host", "miss")
    width = 0.8 / max(len(runs), 1)
    batched = any("batch" in r for _, _, reqs in runs for r in reqs[:1])
    for j, (label, _, reqs) in enumerate(runs):
        means = []
        for t in tiers:
            if batched:  # a batch's latency once per batch that holds a request of the tier
                per = {r["batch"]: r["latency_ms"] for r in reqs if r["tier"] == t}
                vals = list(per.values())
            else:
                vals = [r["latency_ms"] for r in reqs if r["tier"] == t]
            means.append(np.mean(vals) if vals else 0.0)
        ax.bar(np.arange(len(tiers)) + j * width, means, width, label=label)
    ax.set_xticks(np.arange(len(tiers)) + width * (len(runs) - 1) / 2, tiers)
    ax.set(ylabel="mean latency (ms)", title="Latency by tier" + (
        " (batches holding a request of the tier)" if batched else ""))
    ax.legend()
    save(fig, "latency_by_tier.png")


def _generate_plots(plt, runs, save) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, _, reqs in runs:
        ax.plot([r["index"] for r in reqs], [r["latency_ms"] for r in reqs], ".", ms=2,
                label=label)
    ax.set(xlabel="request", ylabel="latency (ms)", title="Latency over the replay")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "latency_over_time.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [lab for lab, _, _ in runs]
    queue = [np.mean([r["queue_ms"] for r in reqs] or [0]) for _, _, reqs in runs]
    compute = [np.mean([r["compute_ms"] for r in reqs] or [0]) for _, _, reqs in runs]
    ax.bar(labels, queue, label="queue")
    ax.bar(labels, compute, bottom=queue, label="compute")
    ax.set(ylabel="mean ms per request", title="Queue and compute time")
    ax.legend()
    save(fig, "queue_compute.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
