#!/usr/bin/env bash
# lorascope's GPU check: every CUDA path of the probes and the analysis on a real GPU, in
# one command, at most 9 minutes on one GPU (`--quick`: the real-size part alone), ending in a table of what it verified
# (benchmarks/gpu_check.py says what each run checks). Without CUDA it says it skipped
# and exits 0.
#
#   bash benchmarks/gpu_check.sh            # from the repository root or anywhere
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # figures + fixtures also land in $OUT
#
# It runs lorascope from this checkout (PYTHONPATH), with the machine's own torch,
# transformers, peft, click, psutil, jinja2 and nvidia-ml-py. DeepSpeed (and hjson,
# pydantic ...) is optional: the core checks use DDP (--engine torch); a ZeRO-3 run is
# added when DeepSpeed imports, e.g. from wheels prepared beforehand on a machine with a
# package index (CPU is fine; Python 3.12, manylinux x86_64), into the git-ignored .whl/:
#
#   bash benchmarks/gpu_check.sh --prepare-wheels
#
# and carried with the tree (it is ~10 MB; the device tool: carry [".whl"]). Here they
# are installed with `pip install --no-index --target .whl/site`, nothing fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT_S=${GPU_CHECK_LIMIT_S:-540}

if [ "${1:-}" = "--prepare-wheels" ]; then
  rm -rf .whl && mkdir -p .whl
  "$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl hjson msgpack ninja py-cpuinfo einops "pydantic>=2"
  # DeepSpeed is an sdist: build its pure-Python wheel (no ops) against the torch here.
  DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -w .whl "deepspeed${DEEPSPEED_VERSION:+==$DEEPSPEED_VERSION}"
  rm -f .whl/typing_extensions-*.whl  # the machine's own is kept
  du -sh .whl && ls .whl
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  why=$("$PY" -c "import torch; print('no CUDA device (torch', torch.__version__ + ')')" 2>/dev/null || echo "torch is not importable")
  echo "gpu_check: skipped: $why; nothing checked"
  exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import deepspeed" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --target .whl/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$PWD/.whl/site" \
    || echo "gpu_check: the wheels in .whl/ did not install; the ZeRO-3 run will be skipped"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# SIGTERM first (the script still prints its table), SIGKILL 15 s later.
exec timeout --kill-after=15 "$LIMIT_S" "$PY" benchmarks/gpu_check.py "$@"
