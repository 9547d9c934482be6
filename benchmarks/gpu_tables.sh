#!/usr/bin/env bash
# One command for a lent GPU (written for an NVIDIA H200 and a <=10-minute slot): the rollout sampler table
# (jopd vs transformers on CUDA, benchmarks/sampler.py --random-weights) and the step-waste table
# (benchmarks/step_waste.py --workloads skewed, "before" vs "after"), each for SmolLM2-135M's and Qwen2.5-0.5B's
# architecture with random weights (nothing is downloaded).
#
#   bash benchmarks/gpu_tables.sh            # GPU: JAX on CUDA, transformers on cuda
#   bash benchmarks/gpu_tables.sh --smoke    # (or SMOKE=1) the same pipeline on CPU, tiny sizes, to check it
#
# Writes under ${OUT:-benchmarks/results/gpu} (smoke: ${OUT:-benchmarks/results/gpu-smoke}): env.txt (devices,
# versions), one <part>.txt per table (its stdout) and <part>.log (its stderr), step_waste_<arch>.json/.png,
# summary.txt (each part's command, exit status and seconds) and failures.txt (parts that failed, timed out or
# were skipped; absent when none did). The whole run keeps to a budget, BUDGET_S (default 530 s on the GPU, 900 s
# in smoke mode); each of the 4 parts runs under `timeout` with what is left of it less FLOOR_S (default 120 s;
# smoke 150 s) for each part still to come, so one slow part cannot take the others' time and time a part leaves
# unused goes to the later ones. A part that fails or times out is recorded and the next one runs; the script
# exits 1 if any did. Other knobs (environment): PYTHON (default python3), OUT.
set -euo pipefail

SMOKE="${SMOKE:-0}"
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (use --smoke or nothing)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."  # the repo root
START=$(date +%s)
if [[ "$SMOKE" == 1 ]]; then BUDGET_S="${BUDGET_S:-900}" FLOOR_S="${FLOOR_S:-150}"
else BUDGET_S="${BUDGET_S:-530}" FLOOR_S="${FLOOR_S:-120}"; fi
DEADLINE=$((START + BUDGET_S))
PARTS_LEFT=4  # run_part calls still to come
MIN_PART_S=20  # a part that would get less than this is skipped (recorded in failures.txt)
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

SMOL=configs/arch/smollm2-135m-instruct/config.json
QWEN=configs/arch/qwen2.5-0.5b-instruct/config.json

if [[ "$SMOKE" == 1 ]]; then
  OUT="${OUT:-benchmarks/results/gpu-smoke}"
  export JAX_PLATFORMS=cpu
  HF_DEVICE=cpu
  SAMPLER_COMMON=(--prompt-tokens 8 --new-tokens 8 --repeats 1)
  SMOL_BATCHES=1,2
  QWEN_BATCHES=1,2
  WASTE_COMMON=(--steps 1 --warmup 1 --skewed-batch 4 --skewed-max-new-tokens 8)
else
  OUT="${OUT:-benchmarks/results/gpu}"
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"  # step_waste.py defaults to cpu unless this is set
  export JOPD_XLA_DEFAULTS=0  # jopd's XLA_FLAGS are XLA:CPU settings: leave XLA_FLAGS alone on the GPU
  HF_DEVICE=cuda
  SAMPLER_COMMON=(--repeats 2)  # the script's defaults otherwise: 32-token prompts, 64 new tokens, top-p 0.9
  SMOL_BATCHES=1,16,64,256
  QWEN_BATCHES=1,16,64
  WASTE_COMMON=(--steps 3 --warmup 2)  # skewed defaults otherwise: batch 16, up to 256 new tokens
fi
mkdir -p "$OUT"
rm -f "$OUT/failures.txt" "$OUT/summary.txt"

say() { echo "[gpu_tables $(($(date +%s) - START))s] $*"; }
fail() { echo "$*" >> "$OUT/failures.txt"; say "FAILED: $*"; }

# run_part NAME CMD...: CMD's stdout to the console and $OUT/NAME.txt, its stderr to $OUT/NAME.log, under
# `timeout` (the budget left, less FLOOR_S per part still to come); a failure is recorded and does not stop the run.
run_part() {
  local name=$1; shift
  PARTS_LEFT=$((PARTS_LEFT - 1))
  local left=$((DEADLINE - $(date +%s)))
  local limit=$((left - PARTS_LEFT * FLOOR_S))
  echo "$name: $*" >> "$OUT/summary.txt"
  if ((limit < MIN_PART_S)); then
    fail "$name: skipped, ${left}s of the ${BUDGET_S}s budget left"
    echo "$name: skipped" >> "$OUT/summary.txt"
    return 0
  fi
  say "$name (timeout ${limit}s): $*"
  local t0 rc
  t0=$(date +%s)
  set +e
  timeout --kill-after=10 "$limit" "$@" 2> "$OUT/$name.log" | tee "$OUT/$name.txt"
  rc=${PIPESTATUS[0]}
  set -e
  local took=$(($(date +%s) - t0))
  echo "$name: exit $rc after ${took}s (limit ${limit}s)" >> "$OUT/summary.txt"
  if ((rc == 124 || rc == 137)); then
    fail "$name: timed out after ${took}s (limit ${limit}s); partial stdout in $name.txt"
  elif ((rc != 0)); then
    local why  # the last exception line of its stderr, else its last line
    why=$(grep -E '^[A-Za-z_.]*(Error|Exception|Interrupt)\b' "$OUT/$name.log" | tail -n 1 || true)
    [[ -n "$why" ]] || why=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 || true)
    fail "$name: exit $rc after ${took}s: $why (see $name.log)"
  else
    say "$name: done in ${took}s"
  fi
  if ((rc != 0)); then tail -n 15 "$OUT/$name.log" >&2 || true; fi
}

# ---- the machine ----
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "mode: $([[ "$SMOKE" == 1 ]] && echo "smoke (CPU, tiny sizes)" || echo GPU)"
  dirty=$(git status --porcelain 2>/dev/null | head -n 1 || true)
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)${dirty:+ (+ uncommitted changes)}"
  echo "JAX_PLATFORMS=$JAX_PLATFORMS JOPD_XLA_DEFAULTS=${JOPD_XLA_DEFAULTS:-} XLA_FLAGS=${XLA_FLAGS:-} python: $PYTHON"
  echo "CPUs: $(nproc)"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi -L || true
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  else
    echo "nvidia-smi: not found"
  fi
} 2>&1 | tee "$OUT/env.txt"
set +e
timeout 120 "$PYTHON" - >> "$OUT/env.txt" 2>&1 <<'EOF'
import importlib, platform
print("python", platform.python_version())
for m in ("jax", "jaxlib", "numpy", "torch", "transformers", "matplotlib"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "not importable:", type(e).__name__, e)
import jax
print("jax.devices():", jax.devices(), "default backend:", jax.default_backend())
try:
    import torch
    print("torch.cuda:", torch.cuda.is_available(), torch.version.cuda,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:  # noqa: BLE001
    print("torch.cuda: not checked:", e)
import jopd  # noqa: F401
print("jopd importable")
EOF
rc=$?
set -e
sed -n '/^python /,$p' "$OUT/env.txt"
((rc == 0)) || fail "env: the version/device probe exited $rc (see env.txt)"

# ---- (a) rollout sampler: jopd vs transformers ----
run_part sampler_smollm2 env XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}" \
  "$PYTHON" -u benchmarks/sampler.py --random-weights "$SMOL" --hf-device "$HF_DEVICE" \
  --batch-sizes "$SMOL_BATCHES" "${SAMPLER_COMMON[@]}"
run_part sampler_qwen2.5-0.5b env XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}" \
  "$PYTHON" -u benchmarks/sampler.py --random-weights "$QWEN" --hf-device "$HF_DEVICE" \
  --batch-sizes "$QWEN_BATCHES" "${SAMPLER_COMMON[@]}"

# ---- (b) step waste, the skewed workload: before vs after ----
run_part step_waste_smollm2 "$PYTHON" -u benchmarks/step_waste.py --workloads skewed \
  --skewed-arch "$SMOL" --skewed-student-layers 12 "${WASTE_COMMON[@]}" --out "$OUT" --tag smollm2
run_part step_waste_qwen2.5-0.5b "$PYTHON" -u benchmarks/step_waste.py --workloads skewed \
  --skewed-arch "$QWEN" --skewed-student-layers 8 "${WASTE_COMMON[@]}" --out "$OUT" --tag qwen2.5-0.5b

say "all parts run in $(($(date +%s) - START))s; results in $OUT"
cat "$OUT/summary.txt"
if [[ -s "$OUT/failures.txt" ]]; then
  echo "--- failures ---"
  cat "$OUT/failures.txt"
  exit 1
fi
