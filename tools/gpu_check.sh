#!/usr/bin/env bash
# The whole GPU check in one call: GPU tests, then the benchmarks, then a short table.
# Run on the lent H200 from the repository root (docs/benchmarks.md records the figures):
#   bash tools/gpu_check.sh [tests|quick|full|rank|gen|attn|topk|inflight|genprof|update|verify|
#                            rankprof|reprof|attnprof|first|hosthit|hostprobe]
#     tests: the gpu-marked tests only; quick: + transfer bench + a short rank-ref bench;
#     full: + the rank-ref bench at batch 1, 4, 8 (several minutes) + the gen-ref bench;
#     rank: the rank-ref bench alone; gen: the generate GPU tests + the gen-ref bench;
#     attn: the kernel, rank and cache GPU tests + tools/bench_attention.py (ATTN_ARGS=--quick);
#     topk: the selection GPU tests + tools/bench_topk.py, then again under each NAME=VALUE of
#       TOPK_AB (e.g. TOPK_AB="STREAMGR_TOPK_LEVELS=1 STREAMGR_TOPK_BINS=0 STREAMGR_TOPK_MERGE=0")
#     inflight: rank-ref trace replays through the engine at engine.rank_in_flight 1 and 2
#     genprof: the gen-ref bench alone with a torch.profiler kernel table and a host profile
#       (no tests)
#     update: the GPU tests, then tools/bench_update.py on gen-ref (live updates under traffic)
#     verify: the GPU tests, bench_update on gen-ref, then the gen-ref bench (GEN_RATES)
#     rankprof: tools/profile_rank.py on rank-ref (kernel table of cached batches of 8; no tests)
#     reprof: the same for recompute batches of 8 (users from the middle of their trace), with
#       the last batch's timeline: where an eager recompute batch's ~2 ms beyond its kernels go
#       (PROF_ARGS=--unsynced: the batches as served, not stage-synced)
#     first: rank-ref first visits one batch at a time (the first 2,400 requests of a fresh
#       trace), FIRST_RUNS times (default 1) with the modes interleaved batch by batch
#       (bench_rank --interleave: the host's drift weighs on every mode alike), each mode's
#       engine first warmed by FIRST_WARM (4) untimed batches of other users; FIRST_INTERLEAVE=0
#       runs the modes one after another, alternating the batch and mode orders between runs
#       (FIRST_RUNS 3 then; sessions 13-22's method: single runs disagreed); no tests
#     hosthit: rank-ref at batch 8 with a device tier of 8,192 pages, so that most hits come
#       from host chunks (issue 12's host-hit target; no tests), once per cache.onload_split
#       in HOSTHIT_SPLITS (default "auto"; e.g. "auto 0.0 1.0" for the A/B)
#     hostprobe: tools/probe_hosthit.py on rank-ref's host hits (onload_split / window / flag
#       settings interleaved, default "auto auto::fixed auto::thread 1.0": the split
#       corrected from device timings (the engine's default) or as measured at start, the
#       onload from the batch's thread or the onload thread (nopad: eager rows not bucketed); per-layer timeline,
#       then per PROBE_TRACE setting two batches' slow host calls and kernel table beside
#       recompute's; PROBE_CONFIGS; no tests)
#     attnprof: ncu on the attention forward kernels (mma.sync and wgmma) with stall reasons and
#       the source lines they stall on (STREAMGR_NVRTC_LINEINFO=1; no tests)
#   env: CATALOG_EVERY (update: every N-th update also changes the catalog; 0: refits only),
#   UPDATE_ARGS (more bench_update flags, e.g. "--checkpoints 4": refits from files, not seeds),
#   WARMUP/WINDOW (rank bench requests), RANK_ARGS (more rank bench flags, e.g.
#   "--stage-every 5": latency over batches without stage syncs), GEN_REQUESTS (per gen-ref run), GEN_RATES
#   (open-loop requests/s), GEN_CONC (closed-loop requests in flight: 192, four of gen-ref's
#   batches of 48), HF_REQUESTS (through Hugging Face), GEN_ARGS (more bench flags,
#   e.g. "--profile 2 --fp32-agreement 16")
# Needs the fixing wheels of ../shared/device/prep.sh carried in .device/ on that machine.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-full}
if [ -d .device/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
out=${OUT:-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, numpy, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'cupy', cupy.__version__)"

summary=()
if [ "$mode" != rank ] && [ "$mode" != inflight ] && [ "$mode" != genprof ] \
    && [ "$mode" != rankprof ] && [ "$mode" != reprof ] && [ "$mode" != attnprof ] \
    && [ "$mode" != first ] \
    && [ "$mode" != hosthit ] && [ "$mode" != hostprobe ]; then
  tests=tests/
  [ "$mode" = gen ] && tests=tests/runtime/test_gpu_generate.py
  [ "$mode" = attn ] && tests="tests/kernels/test_gpu_kernels.py tests/engine/test_gpu_rank.py tests/cache/test_gpu_cache.py"
  [ "$mode" = topk ] && tests="tests/kernels/test_gpu_trie_topk.py tests/runtime/test_gpu_generate.py"
  python3 -m pytest -q -s -m gpu $tests -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" \
    | grep -i "agreement\|overlap\|passed\|failed\|error" | tail -n 30
  summary+=("gpu tests: $(tail -n 1 "$out/gpu_tests.log")")
fi

if [ "$mode" = attn ] || [ "$mode" = full ]; then
  python3 tools/bench_attention.py ${ATTN_ARGS:-} --json "$out/bench_attention.json" \
    2>"$out/bench_attention.err" | tee "$out/bench_attention.txt"
  tail -n 5 "$out/bench_attention.err"
  summary+=("$(tail -n 1 "$out/bench_attention.txt")")
fi
if [ "$mode" = topk ] || [ "$mode" = full ]; then
  python3 tools/bench_topk.py 2>"$out/bench_topk.err" | tee "$out/bench_topk.txt"
  summary+=("$(tail -n 1 "$out/bench_topk.txt")")
  for ab in ${TOPK_AB:-}; do  # each NAME=VALUE setting's run right after, on the same machine
    f="$out/bench_topk_${ab//[^A-Za-z0-9]/_}.txt"
    env "$ab" python3 tools/bench_topk.py 2>>"$out/bench_topk.err" | tee "$f"
    summary+=("$ab: $(tail -n 1 "$f")")
  done
fi
if [ "$mode" = quick ] || [ "$mode" = full ]; then
  python3 tools/bench_transfer.py --chunks 64 2>"$out/bench_transfer.err" | tee "$out/bench_transfer.txt"
  tail -n 5 "$out/bench_transfer.err"
  summary+=("$(tail -n 1 "$out/bench_transfer.txt")")
fi
# 400 KuaiRand-like users from the middle of their trace: ~2.6M history tokens, twice the 40,960
# device pages; the pinned host tier (3,600 chunks, 56 GiB) holds them all.
rank_ref=(--spec rank-ref --profile kuairand-1k --users 400 --start-frac 0.5 --prefill
          --set cache.host_chunks=3600)
if [ "$mode" = quick ]; then
  python3 tools/bench_rank.py "${rank_ref[@]}" --batch 8 --warmup 400 --window 400 \
    --recompute-every 4 ${RANK_ARGS:-} --json "$out/bench_rank_quick.json" 2>"$out/bench_rank_quick.err" \
    | tee "$out/bench_rank_quick.txt"
  grep -v "^\(recompute\|gpu-only\|hierarchical\)" "$out/bench_rank_quick.err" | tail -n 15
  summary+=("$(tail -n 1 "$out/bench_rank_quick.txt")")
fi
if [ "$mode" = full ] || [ "$mode" = rank ]; then
  python3 tools/bench_rank.py "${rank_ref[@]}" --batch 1 4 8 --warmup ${WARMUP:-1500} --window ${WINDOW:-1500} \
    --recompute-every 4 ${RANK_ARGS:-} --json "$out/bench_rank.json" 2>"$out/bench_rank.err" \
    | tee "$out/bench_rank.txt"
  grep -v "^\(recompute\|gpu-only\|hierarchical\)" "$out/bench_rank.err" | tail -n 15
  summary+=("$(tail -n 1 "$out/bench_rank.txt")")
fi
if [ "$mode" = hosthit ]; then
  for split in ${HOSTHIT_SPLITS:-auto}; do  # cache.onload_split values, one run each
    f="$out/bench_rank_hosthit_$split"
    python3 tools/bench_rank.py "${rank_ref[@]}" --batch 8 --warmup 400 --window 400 --recompute-every 4 \
      --stage-every 5 --set cache.device_pages=8192 --set cache.onload_split=$split ${RANK_ARGS:-} \
      --json "$f.json" 2>"$f.err" | tee "$f.txt"
    grep "split costs" "$f.err"
    summary+=("host hits, onload_split $split: $(grep '^host (mean ms)' "$f.txt"); $(tail -n 1 "$f.txt")")
  done
fi
if [ "$mode" = hostprobe ]; then
  python3 tools/probe_hosthit.py --spec rank-ref --set cache.device_pages=8192 --warmup 200 \
    --window 640 --configs ${PROBE_CONFIGS:-auto auto::fixed auto::thread 1.0} --trace ${PROBE_TRACE:-auto} \
    --json "$out/probe_hosthit.json" 2>"$out/probe_hosthit.err" | tee "$out/probe_hosthit.txt"
  summary+=("$(grep -m1 '^auto: ' "$out/probe_hosthit.txt")")
fi
if [ "$mode" = inflight ]; then
  # Batches overlap only inside the engine (bench_rank runs one batch at a time), so this is
  # a closed-loop trace replay: the same requests at 1 and 2 rank batches in flight.
  python3 -m streamgr trace synth --profile kuairand-1k --users ${INFLIGHT_USERS:-400} -o /tmp/kr.trace
  for k in 1 2; do
    python3 -m streamgr trace replay /tmp/kr.trace --spec rank-ref --concurrency ${INFLIGHT_CONC:-32} \
      --limit ${INFLIGHT_LIMIT:-4000} --set engine.rank_in_flight=$k -o "$out/replay_inflight$k.jsonl" \
      2>&1 | tail -n 12 | tee "$out/replay_inflight$k.txt"
    summary+=("rank_in_flight=$k: $(grep "^ *hierarchical " "$out/replay_inflight$k.txt" | tail -n 1)")
  done
fi
if [ "$mode" = update ] || [ "$mode" = verify ]; then
  python3 tools/bench_update.py --spec gen-ref --device cuda --rate ${UPDATE_RATE:-1000} \
    --seconds ${UPDATE_SECONDS:-8} --catalog-every ${CATALOG_EVERY:-3} ${UPDATE_ARGS:-} \
    2>"$out/bench_update.err" | tee "$out/bench_update.txt"
  tail -n 5 "$out/bench_update.err"
  summary+=("$(tail -n 1 "$out/bench_update.txt")")
fi
if [ "$mode" = first ]; then
  il=${FIRST_INTERLEAVE:-1}
  runs=${FIRST_RUNS:-$([ "$il" = 1 ] && echo 1 || echo 3)}
  for i in $(seq 1 $runs); do
    # even runs reverse the batch sizes and the modes: a mode's place in the process (the
    # first cached mode pays one-time costs) must not pass for its cost
    order="8 1"; modes="recompute gpu-only hierarchical"
    [ $((i % 2)) -eq 0 ] && order="1 8" && modes="hierarchical gpu-only recompute"
    python3 tools/bench_rank.py --spec rank-ref --profile kuairand-1k --users 1000 --limit 2400 \
      --warmup-frac 0 --batch $order --mode-order $modes --warm-batches ${FIRST_WARM:-4} \
      --set cache.host_chunks=3600 $([ "$il" = 1 ] && echo --interleave) \
      --json "$out/bench_first$i.json" \
      2>"$out/bench_first$i.err" | tee "$out/bench_first$i.txt" | grep "^BS=\|median"
    summary+=("first visits run $i: $(grep '^Latency median' "$out/bench_first$i.txt")")
  done
fi
if [ "$mode" = rankprof ]; then
  python3 tools/profile_rank.py --spec rank-ref --users ${PROF_USERS:-96} --batch 8 \
    --batches ${PROF_BATCHES:-60} --profile 5 --rows 30 2>"$out/profile_rank.err" \
    | tee "$out/profile_rank.txt"
  summary+=("$(tail -n 1 "$out/profile_rank.txt")")
fi
if [ "$mode" = reprof ]; then
  python3 tools/profile_rank.py --spec rank-ref --users 400 --start-frac 0.5 --batch 8 \
    --batches 12 --profile 3 --rows 25 --timeline ${PROF_GAPS:-12} ${PROF_ARGS:-} --set cache.mode=recompute \
    --set cache.host_chunks=16 2>"$out/profile_recompute.err" > "$out/profile_recompute.txt"
  grep -A 40 "^stages per batch" "$out/profile_recompute.txt" | grep -v "^ .* \(host\|dev \) "
  summary+=("$(grep '^profile_rank' "$out/profile_recompute.txt")")
fi
if [ "$mode" = attnprof ]; then
  for kern in mma wgmma; do
    # The third forward launch of --ncu is recompute at batch 8; the first, cached at batch 8.
    STREAMGR_HSTU_KERNEL=$kern STREAMGR_NVRTC_LINEINFO=1 ncu -k regex:hstu_attn_fwd \
      --launch-skip ${NCU_SKIP:-2} --launch-count 1 --section SourceCounters \
      --section WarpStateStats --section ComputeWorkloadAnalysis --print-details all \
      python3 tools/bench_attention.py --ncu > "$out/ncu_$kern.txt" 2>&1
    grep -iE "stall|Duration|pipe|Executed Ipc" "$out/ncu_$kern.txt" | head -n 40
    summary+=("attnprof $kern: $(grep -m1 'Duration' "$out/ncu_$kern.txt")")
  done
fi
if [ "$mode" = genprof ]; then
  python3 tools/bench_generate.py --spec gen-ref --device cuda --requests ${GEN_REQUESTS:-4000} \
    --concurrency ${GEN_CONC:-192} --rates ${GEN_RATES:-} --hf-requests 1 --profile 2 --host-profile ${GEN_ARGS:-} \
    --json "$out/bench_generate.json" 2>"$out/bench_generate.err" | tee "$out/bench_generate.txt"
  grep -v "^\(open loop\|closed loop\)" "$out/bench_generate.err" | tail -n 80
  summary+=("$(tail -n 1 "$out/bench_generate.txt")")
fi
if [ "$mode" = full ] || [ "$mode" = gen ] || [ "$mode" = verify ]; then
  # gen-ref (WORKLOADS.md): 1,000,000 items, beams of 256, top 256, 256 history items.
  python3 tools/bench_generate.py --spec gen-ref --device cuda --requests ${GEN_REQUESTS:-4000} \
    --concurrency ${GEN_CONC:-192} --rates ${GEN_RATES:-3600 4000} --hf-requests ${HF_REQUESTS:-4} \
    --json "$out/bench_generate.json" ${GEN_ARGS:-} 2>"$out/bench_generate.err" | tee "$out/bench_generate.txt"
  grep -v "^\(open loop\|closed loop\)" "$out/bench_generate.err" | tail -n 15
  summary+=("$(tail -n 1 "$out/bench_generate.txt")")
fi

echo
echo "== gpu_check summary =="
printf '%s\n' "${summary[@]}"
