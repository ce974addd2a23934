#!/usr/bin/env bash
# Where the B/16 step's elementwise time goes on a GPU, and what the speed
# options cost (issue 47, docs/performance.md "The elementwise share"), in
# one run that fits a short lease:
#
#   benchmarks/gpu_elementwise.sh OUT [BUDGET_S]      # on the GPU machine
#
# 1. The GPU check's env and step:no_remat sections (the reference step,
#    CUDA graphs on, its kernels by name).
# 2. The same step with command buffers off and an HLO dump beside a
#    3-step trace, joined by benchmarks/hlo_attribution.py: the kernels by
#    what they compute (the exact GELU's erf, LayerNorm, reductions, ...)
#    and by where in the model.
# 3. The step time of each option: the tanh GELU in both towers (as SigLIP
#    and flax's default use), bfloat16 attention logits, XLA attention
#    instead of cuDNN with float32 and with bfloat16 logits.
#
# Each step runs in its own process; a part that no longer fits BUDGET_S
# (default 480) is skipped and says so. Writes OUT/check.log,
# OUT/gpu_check.{md,json}, OUT/attribution.md and OUT/variants.log (small
# files only: the trace and the dump stay under $TMPDIR). The wheels of
# the project's other dependencies come from .whl/ as for gpu_check.sh.
# STEP_ARGS replaces the step's arguments (a CPU smoke run uses the tiny
# model); PARTS (default check,named,options) picks the parts to run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu_elementwise.sh OUT [BUDGET_S]}
BUDGET=${2:-480}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }

source benchmarks/gpu_wheels.sh
export PYTHONPATH="$PWD/benchmarks:$PYTHONPATH"
export PYTHONUNBUFFERED=1
work=${TMPDIR:-/tmp}/prolip_gpu_elementwise
rm -rf "$work" && mkdir -p "$work"

PARTS=",${PARTS:-check,named,options},"
# 1. The GPU check (first on any GPU machine, docs/gpu.md).
[[ $PARTS == *,check,* ]] && "$PYTHON" benchmarks/gpu_check.py --out "$work/check" \
  --sections env,step:no_remat --budget_s "${CHECK_BUDGET_S:-200}" \
  ${CHECK_ARGS:-} 2>&1 | tee "$OUT/check.log"
cp "$work/check/gpu_check.md" "$work/check/gpu_check.json" "$OUT/" 2>/dev/null

read -r -a args <<< "${STEP_ARGS:---config=configs/prolip_b16.py \
--config.batch_size=512 --config.model.remat=False --config.model.scan=False \
--steps=10 --warmup=2}"
step() {  # step NAME [train_step.py flags...]: one timed step, logged
  local name=$1; shift
  if [ "$(left)" -lt 60 ]; then
    echo "== $name: skipped, $(left) s of the budget left" | tee -a "$OUT/variants.log"
    return 1
  fi
  echo "== $name ($*) XLA_FLAGS=${XLA_FLAGS:-}" | tee -a "$OUT/variants.log"
  timeout "$(( $(left) - 5 ))" "$PYTHON" benchmarks/train_step.py \
    "${args[@]}" "$@" 2>&1 | grep -v -E '^(W|I)[0-9]{4}|^WARNING' \
    | tee -a "$OUT/variants.log"
}

# 2. Named kernels: command buffers off, the optimized HLO dumped.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= \
--xla_dump_to=$work/hlo --xla_dump_hlo_as_text \
--xla_dump_hlo_module_re=train_step"
if [[ $PARTS == *,named,* ]] && step named "--profile_dir=$work/trace"; then
  "$PYTHON" benchmarks/hlo_attribution.py --trace "$work/trace" \
    --hlo "$work/hlo" --steps 3 2>&1 | tee "$OUT/attribution.md"
fi
unset XLA_FLAGS

# 3. The options, each against the check's step (CUDA graphs on).
[[ $PARTS == *,options,* ]] || exit 0
step gelu_tanh --config.model.vision.act=gelu_tanh \
  --config.model.text.act=gelu_tanh
step bf16_logits --config.model.attention_logits_dtype=bfloat16
step xla_attention --config.model.attention_impl=xla
step xla_attention_bf16_logits --config.model.attention_impl=xla \
  --config.model.attention_logits_dtype=bfloat16
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/variants.log"
