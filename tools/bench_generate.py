"""Generate benchmark: streamgr's batched trie-constrained beam search against Hugging Face
``generate`` with ``prefix_allowed_tokens_fn`` on the same weights.

One run, in order: a profiled pass (stages synchronized: the per-batch split into encoder,
decoder, selection and compaction), a closed loop over the embedded engine (requests/s, p50/p99),
open-loop Poisson arrivals at each ``--rates`` value (p50/p99 from arrival; the highest rate with
p99 under ``--p99-target`` ms, as WORKLOADS.md reports gen-ref), then the first
``--hf-requests`` requests through Hugging Face one by one: the throughput ratio and the top-k
agreement (the share of Hugging Face's top-k SIDs that streamgr also returns).

  python tools/bench_generate.py --spec gen-small                                   # CPU
  python tools/bench_generate.py --spec gen-ref --device cuda --rates 200 400 800   # the H200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr import Engine  # noqa: E402
from streamgr.api import GenerateRequest  # noqa: E402
from streamgr.config import parse_set_pairs  # noqa: E402
from streamgr.trace.run import drive, summarize  # noqa: E402

from host_probe import probe_ms  # noqa: E402  (tools/, the script's directory)
from host_sampler import HostSampler  # noqa: E402


def hf_model(engine):
    """A ``T5ForConditionalGeneration`` holding the engine's weights, on its device and dtype."""
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = engine.gen_runner.model.cfg
    hc = T5Config(vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff,
                  num_layers=cfg.num_layers, num_decoder_layers=cfg.decoder_layers,
                  num_heads=cfg.num_heads, feed_forward_proj=cfg.feed_forward_proj,
                  tie_word_embeddings=cfg.tie_word_embeddings, decoder_start_token_id=0,
                  pad_token_id=0, eos_token_id=1)
    hf = T5ForConditionalGeneration(hc)
    sd = {k: v.float().cpu() for k, v in engine.gen_runner.model.state_dict().items()}
    missing, _ = hf.load_state_dict(sd, strict=False)
    left = [k for k in missing if "embed_tokens" not in k and not
            (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if left:
        raise RuntimeError(f"weights missing from the Hugging Face model: {left[:5]}")
    return hf.to(engine.device, engine.dtype).eval()


def trie_allowed(trie):
    """``prefix_allowed_tokens_fn`` walking the CSR trie (memoized per prefix)."""
    offs = trie.level_offset
    kids: dict[tuple, list] = {}

    def allowed(batch_id, input_ids):
        prefix = tuple(input_ids.tolist()[1:])
        if prefix not in kids:
            node = 0
            for t, tok in enumerate(prefix):
                lo, hi = trie.ptr[t][node], trie.ptr[t][node + 1]
                node = lo + int(np.searchsorted(trie.codes[t][lo:hi], tok - offs[t]))
            t = len(prefix)
            lo, hi = trie.ptr[t][node], trie.ptr[t][node + 1]
            kids[prefix] = (trie.codes[t][lo:hi] + offs[t]).tolist()
        return kids[prefix]
    return allowed


def hugging_face(eng, reqs, results, n):
    """The first ``n`` requests through HF one at a time: (requests/s, mean top-k agreement);
    (0.0, None) for none (no HF model is built)."""
    if n == 0:
        return 0.0, None
    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf, runner = hf_model(eng), eng.gen_runner
    trie, W0 = runner.trie, max(eng.spec.policy.beam_widths)
    allowed, agree = trie_allowed(trie), []
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r, res in zip(reqs[:n], results):
        ctx, W = runner.prepare(r).context, r.beam_width or W0
        with torch.inference_mode():
            out = hf.generate(input_ids=torch.from_numpy(ctx[None]).to(eng.device),
                              num_beams=W, num_return_sequences=min(r.top_k, W),
                              max_new_tokens=trie.depth, prefix_allowed_tokens_fn=allowed,
                              length_penalty=0.0, do_sample=False, early_stopping=False)
        sids = {tuple(int(x - trie.level_offset[t]) for t, x in enumerate(s[1:]))
                for s in out.tolist()}
        agree.append(len(sids & {tuple(s) for s in res.sids}) / max(len(sids), 1))
    return n / (time.perf_counter() - t0), float(np.mean(agree))


def warm_plans(eng, req) -> None:
    """Capture the decode plan of every row bucket for batches of requests like ``req`` (as a
    live update does, off the executor), so the timed runs do not capture on first sight."""
    act = eng.gen_runner.active
    plans, search = act.search.plans, act.search
    if plans is None:
        return
    p = act.prepare(req)
    keys = {plans.key([p] * n, search.step_widths([p.widths] * n))
            for n in range(1, plans.max_rows + 1)}
    act.warm_up(sorted(keys))


async def profiled(eng, reqs):
    """Batches of ``max_batch`` with each stage synchronized: the mean per-batch split."""
    search, B = eng.gen_runner.search, eng.spec.engine.max_batch
    search.sync = True
    batches: dict[int, dict] = {}
    try:
        for i in range(0, len(reqs), B):
            for res in await asyncio.gather(*(eng.generate(r) for r in reqs[i:i + B])):
                batches[id(res.stats.steps)] = (res.stats.steps, res.stats.batch_size)
    finally:
        search.sync = False
    split = {k: float(np.mean([s.get(k, 0.0) for s, _ in batches.values()]))
             for k in next(iter(batches.values()))[0]}
    return split, float(np.mean([b for _, b in batches.values()]))


def profile(eng, reqs, n):
    """``n`` batches of ``max_batch`` straight through the runner under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    runner, B = eng.gen_runner, eng.spec.engine.max_batch
    batch = [runner.prepare(r) for r in reqs[:B]]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    search = runner.search
    for plans in ([search.plans, None] if search.plans is not None else [None]):
        # With plans: the kernels as the graph replays them. Without (eager): each kernel's
        # time under the aten op and input shapes that launched it.
        search.plans, saved = plans, search.plans
        try:
            runner.run(batch)  # eager: new shapes' set-up outside the profile
            with torch_profile(activities=acts, record_shapes=plans is None) as prof:
                for _ in range(n):
                    runner.run(batch)
                if eng.device.type == "cuda":
                    torch.cuda.synchronize()
        finally:
            search.plans = saved
        print(f"== profile, {n} batches of {len(batch)}, "
              f"{'plans (graph replays)' if plans is not None else 'eager'}", file=sys.stderr)
        key = "cuda_time_total" if eng.device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages(group_by_input_shape=plans is None)
              .table(sort_by=key, row_limit=30, max_name_column_width=60,
                     max_shapes_column_width=70), file=sys.stderr)
        if plans is not None and eng.device.type == "cuda":
            replay_span(plans, search, batch)


def replay_span(plans, search, batch, reps: int = 20) -> None:
    """The batch's plan replayed back to back: its span on the GPU per replay, gaps between
    the graph's kernels included (the profile's total counts the kernels' own time only)."""
    plan = plans.plans.get(plans.key(batch, search.step_widths([p.widths for p in batch])))
    if plan is None:
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    plan.graph.replay()
    start.record()
    for _ in range(reps):
        plan.graph.replay()
    end.record()
    end.synchronize()
    print(f"== the plan replayed back to back: {start.elapsed_time(end) / reps:.3f} ms a "
          f"replay (the table's total: the kernels alone)", file=sys.stderr)


class GcPauses:
    """Wall time of each garbage collection (a suspect for latency tails)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t = 0.0

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)

    def _cb(self, phase, info) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._t) * 1e3))

    def summary(self) -> str:
        if not self.pauses:
            return "no collections"
        ms = [p for _, p in self.pauses]
        g2 = [p for g, p in self.pauses if g == 2]
        return (f"{len(ms)} collections, {sum(ms):.1f} ms in all, longest {max(ms):.1f} ms; "
                f"generation 2: {len(g2)}" + (f" ({', '.join(f'{p:.1f}' for p in g2)} ms)" if g2 else ""))


def stage(t0: float, what: str) -> None:
    """Progress on stderr (a run cut by a time limit still shows where it was)."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def row(r: dict) -> str:
    return f"{r['throughput']:.1f} req/s, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms"


def batch_mix(sizes: list[int], max_batch: int) -> tuple[float, float, float] | None:
    """(batches, mean requests a batch, padding share of the plans' rows) from each request's
    batch size: a batch of b requests runs as ``bucket_rows(b)`` rows, the rest padding that
    costs the GPU what real rows do."""
    from streamgr.runtime.plans import bucket_rows
    counts = Counter(b for b in sizes if b > 0)
    if not counts:
        return None
    n = {b: c / b for b, c in counts.items()}  # batches of each size
    real = sum(k * b for b, k in n.items())
    rows = sum(k * bucket_rows(b, max_batch) for b, k in n.items())
    return sum(n.values()), real / sum(n.values()), 1 - real / rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="gen-small")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--device", default=None)
    ap.add_argument("--requests", type=int, default=256, help="per closed/open-loop run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rates", type=float, nargs="*", default=[], help="open-loop requests/s")
    ap.add_argument("--p99-target", type=float, default=35.0)
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--history", type=int, default=None, help="history items per request")
    ap.add_argument("--beam-width", type=int, default=None,
                    help="beams per step for every request (the policy's widths otherwise)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also run N full batches under torch.profiler and print the top ops")
    ap.add_argument("--host-profile", action="store_true",
                    help="sample every thread's Python stack during the closed-loop run and "
                         "print where the host time goes (tools/host_sampler.py)")
    ap.add_argument("--fp32-agreement", type=int, default=0, metavar="N",
                    help="also compare N requests with Hugging Face both in fp32 (same device)")
    args = ap.parse_args()
    ov = parse_set_pairs(args.overrides)
    if args.device:
        ov["engine.device"] = args.device
    # The SID trie of a gen-ref-sized catalog (1,000,000 items, 3 x 8,192 codes) from scratch.
    from streamgr.selection.vocabulary import SidTrie
    from streamgr.selection.catalog import random_catalog
    t_start = time.perf_counter()
    big = random_catalog(1_000_000, [8192] * 3, 0)
    t = time.perf_counter()
    SidTrie(big, [8192] * 3, 3)
    trie_s = time.perf_counter() - t
    stage(t_start, f"the 1,000,000-item trie built in {trie_s:.2f} s")
    eng = Engine.from_spec(args.spec, ov)
    stage(t_start, "engine built")
    pol, runner = eng.spec.policy, eng.gen_runner
    rng = np.random.default_rng(0)
    n_hist = args.history or pol.max_context_items
    reqs = [GenerateRequest(user_id=u, history=rng.choice(runner.trie.leaf_items, size=n_hist).tolist(),
                            top_k=pol.top_k, beam_width=args.beam_width) for u in range(args.requests)]

    pauses = GcPauses()

    async def run_all():
        async with eng:
            stage(t_start, "engine started (on CUDA: its decode plans captured)")
            await asyncio.gather(*(eng.generate(r) for r in reqs[:args.concurrency]))  # warm-up
            stage(t_start, "warm-up done")
            if args.beam_width:  # the engine's start captured the policy's widths only
                await asyncio.get_running_loop().run_in_executor(None, warm_plans, eng, reqs[0])
            pauses.__enter__()  # from here: the measured part (after start's gc.freeze)
            split, bsz = await profiled(eng, reqs[:4 * eng.spec.engine.max_batch])
            stage(t_start, "per-stage split done")
            results = [await eng.generate(r) for r in reqs[:args.hf_requests]]  # for agreement
            sampler = HostSampler() if args.host_profile else contextlib.nullcontext()
            busy0 = eng.stats()["counters"].get("generate_gpu_us", 0)
            with sampler:
                recs, wall, errs = await drive(eng.generate, reqs, args.concurrency, None,
                                               f"closed loop x{args.concurrency}", True, "closed")
            if args.host_profile:
                print(sampler.table(), file=sys.stderr)
            runs = [summarize("closed", recs, wall, errs, {"concurrency": args.concurrency})]
            stage(t_start, "closed loop: " + row(runs[-1]))
            # The device's busy share of the closed loop (CUDA; the batches' summed spans on
            # their stream): near 100%, the GPU bounds the run; well under, the host does.
            runs[0]["gpu_busy"] = (eng.stats()["counters"].get("generate_gpu_us", 0)
                                   - busy0) / 1e6 / wall
            for rate in args.rates:
                recs, wall, errs = await drive(eng.generate, reqs, 0, rate, f"open loop {rate:g}/s",
                                               True, "open")
                runs.append(summarize("open", recs, wall, errs, {"rate": rate}))
                stage(t_start, f"open loop {rate:g}/s: " + row(runs[-1]))
                # The slowest requests, to tell a slow batch (compute) from a queue behind one.
                slow = sorted(recs, key=lambda r: -r["latency_ms"])[:5]
                runs[-1]["slowest"] = [{k: r[k] for k in ("index", "latency_ms", "queue_ms",
                                                          "compute_ms", "batch_size")} for r in slow]
                runs[-1]["batches"] = batch_mix([r["batch_size"] for r in recs],
                                                eng.spec.engine.max_batch)
            plans = eng.stats().get("decode_plans")
            pauses.__exit__()
        return split, bsz, results, runs, plans
    split, bsz, results, runs, plans = asyncio.run(run_all())
    if args.profile:
        profile(eng, reqs, args.profile)
    hf_rps, agree = hugging_face(eng, reqs, results, args.hf_requests)
    agree32 = None
    if args.fp32_agreement:  # precision apart from implementation: both sides in fp32
        e32 = Engine.from_spec(args.spec, {**ov, "model.dtype": "float32"})

        async def run32():
            async with e32:
                return [await e32.generate(r) for r in reqs[:args.fp32_agreement]]
        _, agree32 = hugging_face(e32, reqs, asyncio.run(run32()), args.fp32_agreement)

    # --beam-width overrides the policy's widths at every step (the requests carry it)
    widths = [args.beam_width] * len(pol.beam_widths) if args.beam_width else pol.beam_widths
    print(f"spec {eng.spec.name} on {eng.device}/{str(eng.dtype).replace('torch.', '')}: "
          f"history {n_hist} items, beam widths {widths}, top_k {pol.top_k}, "
          f"max_batch {eng.spec.engine.max_batch}, {args.requests} requests per run; "
          f"host probe {probe_ms():.0f} ms (tools/host_probe.py: the host's Python speed, "
          f"which moved gen-ref's closed loop 4,237-4,984 req/s in session 14)")
    print(f"{'run':<24}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}")
    for r in runs:
        name = f"closed x{r['concurrency']}" if r["mode"] == "closed" else f"open {r['rate']:g}/s"
        print(f"{name:<24}{r['throughput']:>10.1f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['errors']:>8}")
    if agree is not None:
        print(f"{'hugging face (bs 1)':<24}{hf_rps:>10.1f}")
    for r in runs:
        if r.get("slowest"):
            print(f"open {r['rate']:g}/s slowest (index: latency = queue + compute ms, batch): "
                  + "; ".join(f"{x['index']}: {x['latency_ms']:.1f} = {x['queue_ms']:.1f} + "
                              f"{x['compute_ms']:.1f}, {x['batch_size']}" for x in r["slowest"]))
        if r.get("batches"):
            n, mean, pad = r["batches"]
            print(f"open {r['rate']:g}/s batches: {n:.0f}, mean {mean:.1f} requests, padding "
                  f"{pad:.1%} of the plans' rows")
    if plans is not None:
        print(f"decode plans: {plans}")
    if runs[0].get("gpu_busy"):
        print(f"GPU busy {runs[0]['gpu_busy']:.1%} of the closed loop's wall time (each batch's "
              f"span on its stream, summed)")
    print(f"garbage collection during the runs: {pauses.summary()}")
    print(f"per batch of {bsz:.1f} (stages synchronized), ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    print(f"top-k agreement with Hugging Face over {args.hf_requests} requests: {agree:.3f}"
          if agree is not None else "top-k agreement with Hugging Face: skipped (--hf-requests 0)")
    if agree32 is not None:
        print(f"top-k agreement with Hugging Face, both fp32, over {args.fp32_agreement} "
              f"requests: {agree32:.3f}")
    print(f"SID trie of 1,000,000 items built in {trie_s:.2f} s")
    ok = [r["throughput"] for r in runs if r["mode"] == "open" and r["p99_ms"] < args.p99_target
          and r["errors"] == 0]
    closed = runs[0]["throughput"]
    line = f"bench_generate {eng.spec.name}: {closed:.1f} req/s closed-loop"
    if agree is not None:  # --hf-requests 0 skips Hugging Face
        line += (f" vs Hugging Face {hf_rps:.1f} req/s ({closed / hf_rps:.1f}x); top-k agreement "
                 f"{agree:.3f}")
    if args.rates:
        line += (f"; open loop at p99 < {args.p99_target:g} ms: "
                 + (f"{max(ok):.1f} req/s" if ok else "none of the rates"))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "split_ms": split, "hf_rps": hf_rps,
                                               "agreement": agree, "agreement_fp32": agree32, "trie_s": trie_s}, indent=1))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
