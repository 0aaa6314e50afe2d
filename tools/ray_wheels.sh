#!/usr/bin/env bash
# Ray Serve onto a lent GPU machine, which reaches no package index and takes at most 64 MiB per
# call (issue 16): the wheels travel in parts over consecutive calls while the machine is warm.
#   here:   bash tools/ray_wheels.sh prepare      # .device/ray/part0..N (<= 40 MiB each)
#   there:  bash tools/ray_wheels.sh stage K      # one call per part, carry [".device/ray/partK"]
#           bash tools/ray_wheels.sh install      # then (carry [".device/wheels"] as usual):
#                                                 # join the parts, install into /tmp/site
# The calls must follow each other while the machine is warm (~30 s idle): /tmp/raystage is lost
# with it.
# numpy is left out (the machine's own, or .device/wheels' 2.4, must stay: numba-cuda breaks on 2.5).
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${RAY_STAGE:-/tmp/raystage}
case "${1:-}" in
  prepare)
    rm -rf .device/ray && mkdir -p .device/ray/all
    grep -qxF '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    python3 -m pip download -q "ray[serve]==${RAY_VERSION:-2.60.0}" --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .device/ray/all
    rm -f .device/ray/all/numpy-*.whl
    (cd .device/ray/all && for w in ray-*.whl; do split -b 38m -d "$w" "$w.part-" && rm "$w"; done)
    # First fit by size into parts of at most 40 MiB.
    python3 - <<'PY'
import os, shutil
src = ".device/ray/all"
files = sorted(os.listdir(src), key=lambda f: -os.path.getsize(os.path.join(src, f)))
parts, sizes, cap = [], [], 40 << 20
for f in files:
    n = os.path.getsize(os.path.join(src, f))
    for i, s in enumerate(sizes):
        if s + n <= cap:
            parts[i].append(f); sizes[i] += n
            break
    else:
        parts.append([f]); sizes.append(n)
for i, fs in enumerate(parts):
    os.makedirs(f".device/ray/part{i}")
    for f in fs:
        shutil.move(os.path.join(src, f), f".device/ray/part{i}/{f}")
os.rmdir(src)
print(f"{len(parts)} parts: " + ", ".join(f"part{i} {s / 2**20:.1f} MiB" for i, s in enumerate(sizes)))
PY
    ;;
  stage)
    mkdir -p "$stage"
    cp ".device/ray/part${2:?part number}"/* "$stage"/
    ls "$stage" | wc -l
    ;;
  install)
    (cd "$stage" && for p in $(ls *.whl.part-00 2>/dev/null); do
       w=${p%.part-00}; cat "$w".part-* > "$w" && rm "$w".part-*; done)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$stage"/*.whl
    PYTHONPATH=/tmp/site:${PYTHONPATH:-} python3 -c "import ray, ray.serve; print('ray', ray.__version__)"
    ;;
  *)
    echo "usage: bash tools/ray_wheels.sh prepare | stage K | install" >&2
    exit 2
    ;;
esac
