#!/usr/bin/env bash
# One GPU-machine session: build from source, run the test suite, run the benchmarks; logs and result
# files go to $OUT (default ./gpu_out). The GPU machine is bare each time and has no internet: carry
# `.whl` (an expecttest wheel) and `.deps` (triton_kernels; docs/benchmarks.md says how to get both) with the run.
#   usage: bash benchmarks/gpu_session.sh [build] [tests[=PYTEST_ARGS]] [main] [native] [experts] [tune] ...
# Steps run in the order given; "all" = build tests main native experts. Each step stops after
# STEP_TIMEOUT seconds (default 300); the tests log a line per test (-v), so a run cut off by it still names its
# failures, and starts with the run's MOE_TEST_SEED (tests/conftest.py). On 8 workers (pytest-xdist from .whl):
#   tests="-n 8 --dist loadgroup tests"   (loadgroup: the memory-heavy cases one at a time)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
[ -d .deps/tk ] && export PYTHONPATH=$PWD/.deps/tk:${PYTHONPATH:-}
[ -d .deps/dg ] && export PYTHONPATH=$PWD/.deps/dg:${PYTHONPATH:-}
steps=("$@"); [ "${#steps[@]}" -eq 0 ] || [ "${steps[0]}" = all ] && steps=(build tests main native experts)
status=0
for step in "${steps[@]}"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
      start=$SECONDS
      python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      echo "build: $((SECONDS - start)) s"
      python3 -c "import moe_extension as m; print('WITH_CUDA', m.WITH_CUDA, 'archs', m.CUDA_ARCHS)";;
    tests|tests=*)
      args=${step#tests}; args=${args#=}
      timeout "${STEP_TIMEOUT:-300}" python3 -m pytest -v -ra --durations=15 ${args:-tests} >"$OUT/tests.log" 2>&1 || status=1
      tail -60 "$OUT/tests.log";;
    main)
      timeout "${STEP_TIMEOUT:-300}" python3 -m moe_extension 2>&1 | tee "$OUT/main_job.log" || status=1;;
    native)
      timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/bench_native_ops.py --out "$OUT" 2>&1 | tee "$OUT/native.log" || status=1;;
    experts)
      timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/bench_fused_experts.py --out "$OUT" 2>&1 | tee "$OUT/experts.log" || status=1;;
    tune)
      timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/tune_fused_experts.py --out "$OUT" 2>&1 | tee "$OUT/tune.log" || status=1;;
    *) echo "unknown step $step"; status=1;;
  esac
done
exit $status
