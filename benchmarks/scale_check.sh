#!/usr/bin/env bash
# lorascope's scale check on a machine with many cores (the lent 16-core device machine):
# issue 13's goal, 1,024 ranks x 10,000 steps analysed in under 2 minutes, measured as far
# as the machine's disk allows. `benchmarks/rundir_scale.py` writes a 1,024-rank run
# directory in the real format (a planted asymmetry, a straggler, a rank-conditional hang)
# of SCALE_STEPS steps (default 5,000: written, analysed and reported in the time limit
# even on a slow disk), fewer where ~80% of the free disk holds fewer, times `lorascope
# analyze` and `lorascope report` on it, and prints the figures at 10,000 steps linearly in
# the bytes read (an over-estimate: a rank's call file is bounded by its ring).
#
#   bash benchmarks/scale_check.sh --prepare-wheels   # here, with a package index (~36 MB)
#   bash benchmarks/scale_check.sh                    # there (device tool: carry [".whl-scale"])
#
# The analysis needs numpy and sortedcontainers, which the device machine's image may lack:
# --prepare-wheels downloads them (for Python 3.12, manylinux x86_64) into the git-ignored
# .whl-scale/ (it fits the device tool's 64 MiB carry beside the tree); the check installs
# them with `pip install --no-index --target`, nothing fetched. Its output is also written to $OUT/scale.txt when $OUT is set.
# SCALE_RANKS (1024), SCALE_STEPS (5000), SCALE_DIR (/tmp/lorascope-scale) and
# SCALE_CHECK_LIMIT_S (480) change it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.whl-scale
RANKS=${SCALE_RANKS:-1024}
MAX_STEPS=${SCALE_STEPS:-5000}
DIR=${SCALE_DIR:-/tmp/lorascope-scale}
LIMIT_S=${SCALE_CHECK_LIMIT_S:-480}

if [ "${1:-}" = "--prepare-wheels" ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$WHEELS" numpy==2.2.6 sortedcontainers==2.4.0
  du -sh "$WHEELS" && ls "$WHEELS"
  exit 0
fi

if ! "$PY" -c "import numpy, sortedcontainers" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "scale_check: numpy or sortedcontainers is missing and $WHEELS/ holds no wheels (--prepare-wheels first)" >&2
    exit 2
  fi
  site=/tmp/lorascope-scale-site
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$DIR"
# Format v3: ~4.2 KB a rank-step were written at 64 x 1,000 on the test VM (the stream and
# the calls), 5 KB leaves a margin; a rank's call file never takes more than ~13 MB.
STEPS=$("$PY" -c "import shutil, sys; free = shutil.disk_usage(sys.argv[1]).free
print(min(int(sys.argv[3]), int(free * 0.8 / (int(sys.argv[2]) * 5_000)) // 500 * 500))" "$DIR" "$RANKS" "$MAX_STEPS")
if [ "$STEPS" -lt 500 ]; then
  echo "scale_check: $(df -h --output=avail "$DIR" | tail -1 | tr -d ' ') free under $DIR: not enough for $RANKS ranks x 500 steps" >&2
  exit 2
fi
echo "scale_check: $RANKS ranks x $STEPS steps under $DIR ($(nproc) cores, $(df -h --output=avail "$DIR" | tail -1 | tr -d ' ') free)"
run() { timeout --kill-after=15 "$LIMIT_S" "$PY" benchmarks/rundir_scale.py --ranks "$RANKS" --steps "$STEPS" --dir "$DIR"; }
if [ -n "${OUT:-}" ]; then
  set -o pipefail
  run 2>&1 | tee "$OUT/scale.txt"
else
  run
fi
