#!/usr/bin/env bash
# The one-call GPU check (docs/gpu.md): the device and versions, the carried wheels, the package, the
# gpu-marked tests, scripts/bench_gpu.py and ModelOpt's export on the GPU (scripts/bench_modelopt_export.py
# --device cuda), each step under its own timeout and all of them within
# $GPU_CHECK_BUDGET_S; a failing step does not stop the next. Logs and results go to $OUT (the device
# tool's output folder; a new folder under /tmp where it is unset). The last line sums up every step's
# exit status; the script exits 0 only when every step did.
#
#   bash scripts/gpu_check.sh                       # from the repository root, on the GPU machine
#
# Environment: PYTHON (default python3), WHEELS (default wheels: a folder of .whl files, installed with
# --no-index --no-deps into /tmp/gpu-check-site, put on PYTHONPATH), GPU_CHECK_BUDGET_S (default 450),
# GPU_CHECK_TESTS (pytest's targets, default tests/), BENCH_REPS (default 3), BENCH_ARGS (more options
# for bench_gpu.py), GPU_CHECK_SKIP (names of steps to skip, space-separated).
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
SITE=/tmp/gpu-check-site
BUDGET=${GPU_CHECK_BUDGET_S:-450}
TESTS=${GPU_CHECK_TESTS:-tests/}
REPS=${BENCH_REPS:-3}
SKIP=" ${GPU_CHECK_SKIP:-} "
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

DEADLINE=$(($(date +%s) + BUDGET))
SUMMARY=()
FAILED=0

# step NAME CAP_S COMMAND...: run COMMAND under min(CAP_S, the time left), and record its exit status.
step() {
    local name=$1 cap=$2 left rc start
    shift 2
    if [[ $SKIP == *" $name "* ]]; then
        echo "== $name: skipped (GPU_CHECK_SKIP)"
        SUMMARY+=("$name=skipped")
        return 0
    fi
    left=$((DEADLINE - $(date +%s)))
    ((cap > left)) && cap=$left
    if ((cap < 5)); then
        echo "== $name: not run, the budget of ${BUDGET}s is spent"
        SUMMARY+=("$name=no-time")
        FAILED=1
        return 0
    fi
    echo "== $name (at most ${cap}s): $*"
    start=$(date +%s)
    timeout -k 10 "$cap" "$@"
    rc=$?
    echo "== $name: exit $rc after $(($(date +%s) - start))s"
    ((rc == 124 || rc == 137)) && rc="$rc-timeout"
    SUMMARY+=("$name=$rc")
    [[ $rc == 0 ]] || FAILED=1
    return 0
}

main() {
    echo "gpu_check: $(date -u +%FT%TZ) in $ROOT, results in $OUT, budget ${BUDGET}s"
    step machine 30 bash -c '
nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
rc=$?
echo "cpus $(nproc), memlock $(ulimit -l), /dev/shm: $(df -h /dev/shm | tail -1)"
exit $rc
'
    step versions 60 "$PY" -c '
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
    print("cuda:%d" % i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
'
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        step wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl
        export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
        ls "$WHEELS"
    else
        echo "== wheels: no $WHEELS/*.whl here (nvidia-modelopt is used only if already installed)"
        SUMMARY+=("wheels=none")
    fi
    step editable 60 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    step imports 90 "$PY" -W ignore -c '
import distribute_utils, msgpack, filelock, safetensors
print("distribute_utils from", distribute_utils.__file__)
import modelopt, modelopt.torch.export.distribute, modelopt.torch.export.postprocess
print("modelopt", modelopt.__version__, "from", modelopt.__file__)
'
    # shellcheck disable=SC2086  # TESTS: one or more targets, split on purpose
    step gpu-tests 200 "$PY" -m pytest -q -m gpu -rfEs -p no:cacheprovider --continue-on-collection-errors \
        --junitxml="$OUT/pytest-gpu.xml" $TESTS
    # shellcheck disable=SC2086  # BENCH_ARGS: options, split on purpose
    step bench 180 "$PY" scripts/bench_gpu.py --reps "$REPS" --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-}
    step export 120 "$PY" -W ignore scripts/bench_modelopt_export.py --device cuda --reps "$REPS"
    echo "gpu_check: ${SUMMARY[*]} -> $([[ $FAILED == 0 ]] && echo 'all passed' || echo 'SOME FAILED')"
    return $FAILED
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
