#!/usr/bin/env bash
# The whole GPU check in one call: GPU tests, then the benchmarks, then a short table.
# Run on the lent H200 from the repository root (see docs/benchmarks.md for how):
#   bash tools/gpu_check.sh [quick|full]
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
python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)"

summary=()
python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log"
summary+=("gpu tests: $(tail -n 1 "$out/gpu_tests.log")")

python3 -m streamgr demo --set engine.device=cuda 2>/dev/null | tee "$out/demo.txt"
summary+=("demo (rank-small, cuda): $(tail -n 1 "$out/demo.txt" | tr -s ' ')")

if [ "$mode" = full ]; then
  for bench in tools/bench_*.py; do
    [ -f "$bench" ] || continue
    name=$(basename "$bench" .py)
    python3 "$bench" --device cuda 2>&1 | tee "$out/$name.txt"
    summary+=("$name: $(tail -n 1 "$out/$name.txt")")
  done
fi

echo
echo "== gpu_check summary =="
printf '%s\n' "${summary[@]}"
