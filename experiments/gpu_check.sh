#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU, record the device, measure the decode-attention
# kernels (HBM copy bandwidth; achieved K/V bandwidth of the GPU Pallas paged and sparse kernels,
# the engine's XLA path and jax's own GPU paged attention; goals marked met / not met), run the
# GPU kernel tests compiled on the GPU, and a quick engine benchmark; every log and result goes
# into OUTDIR. Prepared to run in one go of at most 8 minutes on an H200 with jax[cuda] installed
# and no network (hydra / wandb are not needed).
#
#   experiments/gpu_check.sh [OUTDIR]            # default: experiments/results/gpu_check/<UTC time>
#   experiments/gpu_check.sh --dry-run [OUTDIR]  # any host: every step at tiny shapes on CPU,
#                                                # kernels in interpret mode (checks the script)
#
# Environment knobs:
#   PYTHON=python3           interpreter; used as it is when it already imports jax and flax
#                            (PYTHONPATH=repo root), else a venv is made and the project installed
#   GPU_VENV=.venv-gpu       venv to create or reuse (--system-site-packages) in that case
#   GPU_CHECK_SKIP_INSTALL=1 use the venv as it is (no pip), e.g. on a machine without network
#   GPU_CHECK_BUDGET=450     seconds for the whole script; each step gets at most what is left
#   GPU_CHECK_DRY_RUN=1      same as --dry-run
#   BENCH_ARGS="--quick"     arguments for experiments/bench.py (add --rows to pick rows)
#
# Results: OUTDIR/SUMMARY.md (one line per step, then the kernel report), OUTDIR/<step>.log,
# OUTDIR/gpu_kernels.{json,md} (gemini_jax/bench/gpu_kernels.py), OUTDIR/kernel_tests.xml,
# OUTDIR/bench/BENCH.md + bench.json, OUTDIR/decode_steps/BENCH.md + bench.json (k-step decode).

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
if [[ "${1:-}" == --dry-run ]]; then DRY_RUN=1; shift; fi
OUT="${1:-$ROOT/experiments/results/gpu_check/$(date -u +%Y-%m-%d_%H-%M-%S)}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
VENV="${GPU_VENV:-$ROOT/.venv-gpu}"
PYTHON="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-450}"
BENCH_ARGS="${BENCH_ARGS:---quick}"
START=$(date +%s)
SUMMARY="$OUT/SUMMARY.md"
cd "$ROOT"

exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "gpu_check: repo $ROOT ($(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
echo "gpu_check: writing to $OUT; budget ${BUDGET}s$( ((DRY_RUN)) && echo '; DRY RUN (CPU, tiny shapes, interpret mode)')"
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "Repo commit: \`$(git rev-parse HEAD 2>/dev/null || echo unknown)\`$(git diff --quiet HEAD -- gemini_jax pallas_kernels 2>/dev/null || echo ' (uncommitted changes)')."
  if ((DRY_RUN)); then
    echo "**DRY RUN**: CPU, tiny shapes, kernels in interpret mode; it checks the script, not the GPU."
    echo
  fi
  echo "| step | exit code | seconds | log |"
  echo "| --- | --- | --- | --- |"
} > "$SUMMARY"

# step NAME MAX_SECONDS CMD...: run CMD with a timeout (capped by what is left of the budget),
# log to OUT/NAME.log and the console, add a line to SUMMARY.md. Never aborts the script.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 10 )); then
    echo "== $name: SKIPPED (budget spent)"
    echo "| $name | skipped (budget) | 0 | |" >> "$SUMMARY"
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "== $name (timeout ${limit}s): $*"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  local note=""
  (( rc == 124 || rc == 137 )) && note=" (timed out)"
  echo "== $name: exit $rc$note after ${dt}s"
  echo "| $name | $rc$note | $dt | [$name.log]($name.log) |" >> "$SUMMARY"
  return 0
}

# ---- 1. the GPU ----------------------------------------------------------------------------
if ((DRY_RUN)); then
  echo "gpu_check: dry run, no GPU needed" | tee "$OUT/nvidia-smi.txt"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or failing); this script is for GPU machines."
  echo "| nvidia-smi | no GPU | 0 | [nvidia-smi.txt](nvidia-smi.txt) |" >> "$SUMMARY"
  exit 2
fi
cat "$OUT/nvidia-smi.txt"
((DRY_RUN)) || nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
  --format=csv > "$OUT/gpu.csv" 2>&1 || true

# ---- 2. python: as it is when it has jax + flax (offline machines), else a venv + install ------
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if "$PYTHON" -c "import jax, flax, numpy" >/dev/null 2>&1; then
  PY="$PYTHON"
  echo "gpu_check: using $PY as it is ($("$PY" -c 'import jax; print("jax", jax.__version__)'))"
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    step venv 60 "$PYTHON" -m venv --system-site-packages "$VENV"
  fi
  PY="$VENV/bin/python"
  if [[ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]]; then
    if command -v uv >/dev/null 2>&1; then
      step install 180 uv pip install --python "$PY" -e ".[cuda12]" "pytest>=8" "hypothesis>=6.100"
    else
      step install 180 "$PY" -m pip install -q --disable-pip-version-check -e ".[cuda12]" "pytest>=8" "hypothesis>=6.100"
    fi
  fi
fi
if ((DRY_RUN)); then
  export JAX_PLATFORMS=cpu
else
  # cuda first (the default backend); cpu beside it: the tiers place their host callbacks
  # (io_callback) on a CPU device, and fail without one.
  export JAX_PLATFORMS=cuda,cpu
fi
export WANDB_MODE=offline

# ---- 3. device ------------------------------------------------------------------------------
step device 60 "$PY" -c '
import jax, jaxlib, sys
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)
print("default backend:", jax.default_backend())
for d in jax.devices():
    print(" ", d, "|", getattr(d, "device_kind", "?"))
'

# ---- 4. kernels: HBM bandwidth, achieved K/V bandwidth, XLA and jax's kernel, goals ----------
if ((DRY_RUN)); then
  step gpu_kernels 150 "$PY" -m gemini_jax.bench.gpu_kernels "$OUT" --dry-run
else
  step gpu_kernels 240 "$PY" -m gemini_jax.bench.gpu_kernels "$OUT"
fi

# ---- 5. GPU kernel tests: compiled on the GPU against the jnp references, and CUDA lowering -----
# (tests/test_{paged,sparse}_decode_kernel.py test the TPU kernels, in interpret mode on CPU: CI.)
KERNEL_TESTS=(tests/test_decode_kernels_gpu.py tests/test_kernel_lowering.py)
((DRY_RUN)) && KERNEL_TESTS=(tests/test_kernel_lowering.py "tests/test_decode_kernels_gpu.py::test_empty_sequences_return_zeros")
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  step kernel_tests 120 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml" "${KERNEL_TESTS[@]}"
else
  echo "| kernel_tests | skipped (no pytest) | 0 | |" >> "$SUMMARY"
fi

# ---- 6. decode with k tokens per device program: tokens/s and fraction of the bandwidth bound,
# k = 1 / 4 / 8 / 16, batch 1 and 8 (no torch needed) ---------------------------------------------
DECODE_ARGS=()
((DRY_RUN)) && DECODE_ARGS=(--quick)
step decode_steps 150 "$PY" experiments/bench.py ${DECODE_ARGS[@]+"${DECODE_ARGS[@]}"} --rows decode_bandwidth --out "$OUT/decode_steps"

# ---- 7. benchmark ---------------------------------------------------------------------------
BENCH_ROWS=()
if ! "$PY" -c "import torch, transformers" >/dev/null 2>&1 && [[ "$BENCH_ARGS" != *--rows* ]]; then
  # dense_vs_hf needs torch + transformers (the hf extra, multi-GB): skip it rather than install.
  BENCH_ROWS=(--rows "$("$PY" experiments/bench.py --list-rows | grep -vx dense_vs_hf | paste -sd, -)")
fi
((DRY_RUN)) && BENCH_ROWS=(--rows kv_bytes)
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
step bench 150 "$PY" experiments/bench.py $BENCH_ARGS ${BENCH_ROWS[@]+"${BENCH_ROWS[@]}"} --out "$OUT/bench"

# ---- 8. summary -----------------------------------------------------------------------------
{
  echo
  echo "Total: $(( $(date +%s) - START )) s. Device: $(tail -n +2 "$OUT/gpu.csv" 2>/dev/null | head -1)."
  if [[ -f "$OUT/gpu_kernels.md" ]]; then
    echo
    cat "$OUT/gpu_kernels.md"
  fi
} >> "$SUMMARY"
echo "gpu_check: done in $(( $(date +%s) - START ))s; results in $OUT (SUMMARY.md)"
