#!/usr/bin/env bash
# The CUDA checks in one go, for a session lent a GPU (the `device` tool: ~15 minutes of device time, commands of at
# most 10): the tests marked `cuda`, then `python -m benchmarks.gpu` on the 1B shape and, shorter, on the 8B one.
# Each step has its own time limit in seconds (TESTS_S, BENCH_1B_S, BENCH_8B_S: 540 in all by default), so that one
# that hangs leaves the others their time, and one that fails does not stop them. Results in $OUT, in 5 files (the
# tool brings back 8 at most): check.log (versions, then each step's output) and gpu_1b / gpu_8b .json and .md (a
# benchmark stopped at its limit writes none: its rows are in check.log, one line per method as it finishes).
# Wheels under .whl/ (carried, see the device tool's README: e.g. liger-kernel for its rows, httpx2 for
# tests/conftest.py if missing there) are installed first.
#   device:  run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#   here:    bash benchmarks/gpu_check.sh --dry-run   (no GPU: collects the tests, checks the benchmarks' arguments)
set -u
OUT=${OUT:-benchmarks/results/gpu_check}
PY=${PYTHON:-python3}
METHODS_8B=${METHODS_8B:-lora,lora+ckpt,tokentune0.2+lora+ckpt,tokentune0.2+lora+8bit+ckpt,lora+liger+ckpt}
DRY=0 FAILED=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$OUT"
LOG="$OUT/check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $DRY = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    $PY - <<'EOF'
import importlib.metadata as metadata

import torch

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.is_available()}")
for name in ("triton", "transformers", "peft", "liger-kernel"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
EOF
} >"$LOG" 2>&1

step() { # step NAME SECONDS DRY_ARG COMMAND...: COMMAND into the log (a dry run: COMMAND DRY_ARG, in 120 s)
    local name=$1 limit=$2 dry_arg=$3 start=$SECONDS rc
    shift 3
    if [ $DRY = 1 ]; then
        set -- "$@" "$dry_arg"
        limit=120
    fi
    echo "=== $name (limit ${limit} s): $*" >>"$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    [ $rc = 0 ] || FAILED=$((FAILED + 1))
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
}

# shellcheck disable=SC2046  # the test files holding `cuda` tests, one word each
step cuda-tests "${TESTS_S:-150}" --collect-only \
    $PY -m pytest -q -rs -n 0 -p no:cacheprovider -m cuda $(grep -rl --include="test_*.py" "mark.cuda" tests)
step gpu-1b "${BENCH_1B_S:-240}" --dry-run $PY -m benchmarks.gpu --out "$OUT"
step gpu-8b "${BENCH_8B_S:-150}" --dry-run \
    $PY -m benchmarks.gpu --shape 8b --warmup 1 --steps 2 --kernel-numel 4096 --methods "$METHODS_8B" --out "$OUT"
exit $FAILED  # the number of steps that failed
