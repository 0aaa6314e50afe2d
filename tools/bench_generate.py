"""Generate benchmark: streamgr's batched trie-constrained beam search against Hugging Face
``generate`` with ``prefix_allowed_tokens_fn`` on the same weights.

Closed loop over the embedded engine (requests/s, p50/p99 latency, time per step split into
encoder, decoder, selection and compaction), then the same requests (fewer if slow) through
Hugging Face one by one, the throughput ratio and the top-k agreement.

  python tools/bench_generate.py --spec gen-small                 # CPU
  python tools/bench_generate.py --spec gen-ref --device cuda     # the H200
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamgr import Engine  # noqa: E402
from streamgr.api import GenerateRequest  # noqa: E402
from streamgr.cli import _overrides  # noqa: E402


def hf_model(engine):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = engine.gen_runner.model.cfg
    hc = T5Config(vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff,
                  num_layers=cfg.num_layers, num_decoder_layers=cfg.decoder_layers,
                  num_heads=cfg.num_heads, feed_forward_proj=cfg.feed_forward_proj,
                  tie_word_embeddings=cfg.tie_word_embeddings, decoder_start_token_id=0,
                  pad_token_id=0, eos_token_id=1)
    hf = T5ForConditionalGeneration(hc)
    sd = {k: v.float().cpu() for k, v in engine.gen_runner.model.state_dict().items()}
    hf.load_state_dict(sd, strict=False)
    return hf.to(engine.device, engine.dtype).eval()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="gen-small")
    ap.add_argument("--set", action="append", dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--device", default=None)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--history", type=int, default=None, help="history items per request")
    args = ap.parse_args()
    ov = _overrides(args.overrides)
    if args.device:
        ov["engine.device"] = args.device
    # The SID trie of a gen-ref-sized catalog (1,000,000 items, 3 x 8,192 codes) from scratch.
    from streamgr.selection.vocabulary import SidTrie, random_catalog
    big = random_catalog(1_000_000, [8192] * 3, 0)
    t = time.perf_counter()
    SidTrie(big, [8192] * 3, 3)
    trie_s = time.perf_counter() - t
    eng = Engine.from_spec(args.spec, ov)
    pol, runner = eng.spec.policy, eng.gen_runner
    rng = np.random.default_rng(0)
    ids = runner.trie.leaf_items
    n_hist = args.history or pol.max_context_items
    reqs = [GenerateRequest(user_id=u, history=rng.choice(ids, size=n_hist).tolist(),
                            top_k=pol.top_k) for u in range(args.requests)]
    runner.search.sync = True

    async def drive():
        lat, steps = [], {}
        async with eng:
            await asyncio.gather(*(eng.generate(r) for r in reqs[:args.concurrency]))  # warm-up
            sem = asyncio.Semaphore(args.concurrency)
            results = [None] * len(reqs)

            async def one(i, r):
                async with sem:
                    t = time.perf_counter()
                    results[i] = await eng.generate(r)
                    lat.append((time.perf_counter() - t) * 1e3)
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
            wall = time.perf_counter() - t0
        batches = {}
        for res in results:
            batches[id(res.stats.steps)] = res.stats.steps
        for st in batches.values():
            for k, v in st.items():
                steps[k] = steps.get(k, 0.0) + v / len(batches)
        return results, np.array(lat), wall, steps, np.mean([r.stats.batch_size for r in results])
    results, lat, wall, steps, bsz = asyncio.run(drive())
    rps = len(reqs) / wall

    # Hugging Face on the same weights and requests (one request at a time, as a baseline).
    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf = hf_model(eng)
    trie = runner.trie
    offs = trie.level_offset
    kids: dict[tuple, list] = {}

    def allowed(batch_id, input_ids):
        prefix = tuple(input_ids.tolist()[1:])
        if prefix not in kids:
            node = 0
            for t, tok in enumerate(prefix):  # walk the CSR trie
                lo, hi = trie.ptr[t][node], trie.ptr[t][node + 1]
                node = lo + int(np.searchsorted(trie.codes[t][lo:hi], tok - offs[t]))
            t = len(prefix)
            lo, hi = trie.ptr[t][node], trie.ptr[t][node + 1]
            kids[prefix] = (trie.codes[t][lo:hi] + offs[t]).tolist()
        return kids[prefix]
    agree = []
    t0 = time.perf_counter()
    W = max(pol.beam_widths)
    for r, res in zip(reqs[:args.hf_requests], results):
        ctx = runner.prepare(r).context
        with torch.inference_mode():
            out = hf.generate(input_ids=torch.tensor([ctx], device=eng.device),
                              num_beams=W, num_return_sequences=min(r.top_k, W),
                              max_new_tokens=trie.depth, prefix_allowed_tokens_fn=allowed,
                              length_penalty=0.0, do_sample=False, early_stopping=False)
        sids = [[int(x - offs[t]) for t, x in enumerate(s[1:])] for s in out.tolist()]
        ours = [s for s in res.sids][:len(sids)]
        agree.append(len({tuple(s) for s in sids} & {tuple(s) for s in ours}) / max(len(sids), 1))
    hf_rps = args.hf_requests / (time.perf_counter() - t0)
    print(f"spec {eng.spec.name} on {eng.device}/{str(eng.dtype).replace('torch.', '')}: "
          f"{len(reqs)} requests, history {n_hist} items, beam widths {pol.beam_widths}, "
          f"top_k {pol.top_k}, concurrency {args.concurrency}, mean batch {bsz:.1f}")
    print(f"{'':<22}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'streamgr':<22}{rps:>10.1f}{np.percentile(lat, 50):>10.2f}{np.percentile(lat, 99):>10.2f}")
    print(f"{'hugging face (bs 1)':<22}{hf_rps:>10.1f}")
    print("per batch, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
    print(f"top-k agreement with Hugging Face over {len(agree)} requests: {np.mean(agree):.3f}")
    print(f"SID trie of 1,000,000 items built in {trie_s:.2f} s")
    print(f"bench_generate {eng.spec.name}: {rps:.1f} req/s vs Hugging Face {hf_rps:.1f} req/s "
          f"({rps / hf_rps:.1f}x); top-k agreement {np.mean(agree):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
