#!/usr/bin/env bash
# The one prepared GPU check: the first thing to run whenever a GPU machine is lent. At most 9
# minutes on one H200 with 16 CPU cores, interpreter starts and torch.compile included.
#
#   benchmarks/gpu_check.sh                 # on a CUDA machine; results in benchmarks/results/gpu/
#   benchmarks/gpu_check.sh --out DIR       # results in DIR
#   benchmarks/gpu_check.sh --dry-run       # every step for a few iterations on the CPU, tiny model
#                                           # and images (CI runs it: tests/run/test_gpu_check.py);
#                                           # results in outputs/gpu_check_dry_run/ unless --out
#
# Each step is a function step_NAME run under its own time budget (seconds, below), plus whatever
# the steps before it left unused, so the whole check stays within the sum of the budgets: a step
# that overruns is stopped and recorded as timed out, a step that fails is recorded as failed, and
# the next step runs either way. Every step writes into RESULTS/NAME/ (its log in step.log) and its key
# figures into RESULTS/NAME/figures.md (benchmarks/gpu_check_report.py reads them from the step's
# files, also after a failure); RESULTS/summary.md lists each step, its status, duration and key
# figures. The exit status is 1 if any step failed, 2 on a usage error.
#
#   environment  nvidia-smi output, torch / CUDA / cuDNN versions, the devices, the framework's fingerprint
#   gpu_tests    pytest -m gpu over tests/gpu/: junit.xml and pytest.log
#   practices    benchmarks/practices.py --preset gpu: ResNet-50 at 224 px on device-made images, one
#                run per setting of 16 steps (5 warm-up + one 10-step window): bf16 vs fp32, TF32
#                on/off, channels_last, fused vs foreach, compile vs eager
#   ladder       the ResNet-50 ladder (benchmarks/ladder_gpu.sh) shortened to 16 steps of batch 128 per
#                stage, no validation; ladder_mfu.md: img/s, speed-up and MFU per stage
#   input_pipeline  benchmarks/input_pipeline.py --device-side: images per host core per decode mode,
#                and the device mode's batched nvjpeg decode + crop on the GPU (input_pipeline.md)
#   progressive_resize  benchmarks/progressive_resize.py: ResNet-50's step samples/s at each size of
#                progressive resizing's default 224 px schedule (128-224 px), beside the fast loader's
#                images per host core at that size, and the schedule's expected time against all-224
#                (progressive_resize.md)
#   batch_study  benchmarks/batch_scaling.py on the GPU: ResNet-18 on the expanded digits at 28 px,
#                batch 512 and 4,096, AdamW's sqrt rule against none, one seed, 2 epochs: final val
#                accuracy at a GPU-sized batch (batch_scaling.md; one seed, so no interval)
#
# A later step (the deploy bench) is a function step_NAME plus its name
# in STEPS and its budgets in BUDGET_S and DRY_BUDGET_S (and, for key figures, a reader in
# benchmarks/gpu_check_report.py). Keep the sum of BUDGET_S within 510 s.
set -uo pipefail

STEPS=(environment gpu_tests practices ladder input_pipeline progressive_resize batch_study)
# Seconds per step on one H200: environment ~5 s; the GPU tests ~90 s (three torch.compile modes
# of a tiny network are most of it); practices 6 runs of ~15-20 s and one compile of ResNet-50
# (~60 s); the ladder one process, six stages, two compiles (the second mostly from the cache the
# practices step filled); the input pipeline ~20 s; of the GPU tests, the deployment ones (a 1-epoch
# digits run, its export, a compiled bench) ~50 s; the batch study four runs of ~10 s in one process;
# progressive resizing ~15 s (an interpreter, 4 sizes of 13 ResNet-50 steps, cuDNN's autotuning of
# each shape, 4 short loader timings) (estimates: neither has run on a GPU yet). 510 s in all, plus
# at most 5 s per step to stop one that overruns. progressive_resize's 20 s come from gpu_tests
# (165 -> 145 s): the one budget with room over its estimate (~90 + ~50 s), and the environment
# step before it leaves ~5 s of its 10; practices and the ladder are at their estimates already.
declare -A BUDGET_S=([environment]=10 [gpu_tests]=145 [practices]=140 [ladder]=130 [input_pipeline]=25
                     [progressive_resize]=20 [batch_study]=40)
# The dry run takes 30-60 s on 2 CPU cores; these only stop a hung step.
declare -A DRY_BUDGET_S=([environment]=40 [gpu_tests]=90 [practices]=120 [ladder]=120 [input_pipeline]=90
                         [progressive_resize]=90 [batch_study]=120)

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

caller_dir=$PWD
cd "$(dirname "$0")/.." || exit 2
DRY=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) [ $# -ge 2 ] || { echo "error: --out needs a folder" >&2; exit 2; }; OUT=$2; shift ;;
    --out=*) OUT=${1#--out=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1'; allowed: --dry-run, --out DIR" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$OUT" ]; then
  if [ "$DRY" = 1 ]; then OUT=outputs/gpu_check_dry_run; else OUT=benchmarks/results/gpu; fi
elif [[ "$OUT" != /* ]]; then
  OUT="$caller_dir/$OUT"
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "error: --out: cannot create '$OUT'" >&2; exit 2; }
PYTHON=${PYTHON:-.venv/bin/python}
export OUT DRY PYTHON
if [ "$DRY" = 1 ]; then
  # Tiny models on a shared CPU: one thread each is several times faster than torch's default
  # (one per core), whose threads spin while other processes hold the cores.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# Fresh records only: a stale file from an earlier check must not pass for this one's.
for name in "${STEPS[@]}"; do rm -rf "${OUT:?}/$name"; done
rm -f "$OUT/summary.md" "$OUT/steps.tsv" "$OUT/run.json"

# -- the steps -------------------------------------------------------------------------------------

step_input_pipeline() {
  local dir="$OUT/input_pipeline"
  local size=(--images 256 --rounds 1 --batches 6 --batch 32)
  [ "$DRY" = 1 ] && size=(--images 24 --rounds 1 --batches 2 --batch 4)
  "$PYTHON" benchmarks/input_pipeline.py --device-side --out "$dir/input_pipeline.md" "${size[@]}"
}

step_progressive_resize() {
  local dir="$OUT/progressive_resize"
  # The loader in the fast mode only and short: the pil comparison is the CPU run's
  # (benchmarks/results/progressive_resize_cpu.md); here what matters is whether 16 host cores keep
  # up with the GPU at the small sizes.
  local size=(--device cuda --model resnet50 --batch 128 --warmup 3 --steps 10 --rounds 1 --images 64 --batches 3)
  [ "$DRY" = 1 ] && size=(--quick --device cpu --model resnet18 --batch 2)
  "$PYTHON" benchmarks/progressive_resize.py --decodes fast --out "$dir/progressive_resize.md" "${size[@]}"
}

step_environment() {
  local dir="$OUT/environment"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi > "$dir/nvidia-smi.txt" 2>&1 || echo "(nvidia-smi exited with status $?)" >> "$dir/nvidia-smi.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,pcie.link.gen.max \
      --format=csv > "$dir/nvidia-smi-query.csv" 2>&1 || true
  else
    echo "nvidia-smi: not found on this machine" > "$dir/nvidia-smi.txt"
  fi
  local require=--require-cuda
  [ "$DRY" = 1 ] && require=""
  "$PYTHON" benchmarks/gpu_check_report.py environment "$dir/environment.json" $require
}

step_gpu_tests() {
  local dir="$OUT/gpu_tests"
  # The dry run hides any GPU from them: every test is collected and skipped with its reason, as
  # on a machine without one (a dry run checks this script's machinery, not the device).
  local hide=()
  [ "$DRY" = 1 ] && hide=(env CUDA_VISIBLE_DEVICES=)
  # A test that hangs fails on its own (pytest-timeout), so junit.xml is still written.
  "${hide[@]}" "$PYTHON" -m pytest -p no:cacheprovider -q -m gpu tests/gpu --timeout=110 \
    --junitxml="$dir/junit.xml" > "$dir/pytest.log" 2>&1
  local status=$?
  tail -n 25 "$dir/pytest.log"
  return $status
}

step_practices() {
  local dir="$OUT/practices"
  local size=()
  if [ "$DRY" = 1 ]; then
    # In this interpreter (no import per run): the table's numbers mean nothing, its making is tested.
    size=(--in-process --base model=small_cnn 'data.shape=[3,8,8]' data.num_classes=10 data.batch_size=4
          data.train_samples=32 data.val_samples=4 data.test_samples=4 trainer.accelerator=cpu)
  else
    size=(--run-timeout 120)
  fi
  "$PYTHON" benchmarks/practices.py --preset gpu --repeats 1 --out "$dir/practices.md" --json "$dir/practices.json" \
    --runs-dir "$dir/runs" "${size[@]}"
}

step_ladder() {
  local dir="$OUT/ladder"
  local size
  if [ "$DRY" = 1 ]; then
    size=(model=small_cnn 'data.shape=[3,8,8]' data.num_classes=10 data.batch_size=4 data.train_samples=32
          data.val_samples=4 data.test_samples=4 trainer.limit_train_batches=8 trainer.limit_val_batches=0
          trainer.limit_test_batches=0 trainer.accelerator=cpu)
  else
    # 16 steps per stage: the meter's 5 warm-up steps (compilation, cuDNN autotuning), then one
    # timed window of 10; no validation or test pass (a compiled stage would compile again for eval).
    size=(data.batch_size=128 data.train_samples=2048 data.val_samples=128 data.test_samples=128
          trainer.limit_train_batches=16 trainer.limit_val_batches=0 trainer.limit_test_batches=0)
  fi
  LADDER_SWEEP_DIR="$dir/multirun" LADDER_RESULTS_DIR="$dir" benchmarks/ladder_gpu.sh "${size[@]}"
  local status=$?
  # The multirun's own exit status is 0 when any stage completed; every stage must have.
  if ! "$PYTHON" benchmarks/gpu_check_report.py ladder "$dir/multirun" "$dir" --check > "$dir/ladder_mfu.log" 2>&1; then
    cat "$dir/ladder_mfu.log"
    [ $status -eq 0 ] && status=1
  fi
  return $status
}

step_batch_study() {
  local dir="$OUT/batch_study"
  local size=(--batches 512,4096 --epochs 2 --accelerator gpu --set model=resnet18 --set data.image_size=28)
  # The dry run: the default network on a tenth of the set, on the CPU.
  [ "$DRY" = 1 ] && size=(--batches 32,64 --epochs 1 --accelerator cpu --set data.copies=2 --set data.eval_copies=1)
  "$PYTHON" benchmarks/batch_scaling.py --studies lr --optimizers adamw --rules sqrt,none --seeds 1 \
    --out "$dir/batch_scaling.md" --runs "$dir/runs" "${size[@]}"
}

export -f step_environment step_gpu_tests step_practices step_ladder step_input_pipeline step_progressive_resize \
  step_batch_study

# -- running them ----------------------------------------------------------------------------------

# run_step NAME BUDGET LIMIT: run step_NAME, stopped after LIMIT seconds (its BUDGET plus what the
# steps before it left); sets ELAPSED_S (whole seconds, rounded up).
run_step() {
  local name=$1 budget=$2 limit=$3 start end rc status
  mkdir -p "$OUT/$name"
  echo "== $name (budget ${budget} s, limit ${limit} s)"
  start=$(date +%s%N)
  # timeout signals the step's whole process group (python, its loader workers, compile workers).
  timeout --kill-after=5 "$limit" bash -c "step_$name" > "$OUT/$name/step.log" 2>&1
  rc=$?
  end=$(date +%s%N)
  ELAPSED_S=$(( (end - start + 999999999) / 1000000000 ))
  case $rc in
    0) status=ok ;;
    124|137) status="timed out" ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$(awk -v s="$start" -v e="$end" 'BEGIN { printf "%.1f", (e - s) / 1e9 }')" \
    "$budget" "$limit" "$rc" >> "$OUT/steps.tsv"
  "$PYTHON" benchmarks/gpu_check_report.py figures "$name" "$OUT/$name" > "$OUT/$name/figures.md" 2>&1
  echo "   $status after $(tail -n 1 "$OUT/steps.tsv" | cut -f3) s: $(head -n 1 "$OUT/$name/figures.md")"
  [ "$status" = ok ]
}

printf 'step\tstatus\tseconds\tbudget_s\tlimit_s\texit\n' > "$OUT/steps.tsv"
printf '{"dry_run": %s, "started": "%s", "command": "benchmarks/gpu_check.sh%s", "python": "%s"}\n' \
  "$([ "$DRY" = 1 ] && echo true || echo false)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  "$([ "$DRY" = 1 ] && echo ' --dry-run')" "$PYTHON" > "$OUT/run.json"
failed=0
unused=0  # seconds the steps so far left of their budgets: the next step may use them
for name in "${STEPS[@]}"; do
  if [ "$DRY" = 1 ]; then budget=${DRY_BUDGET_S[$name]}; else budget=${BUDGET_S[$name]}; fi
  limit=$((budget + unused))
  ELAPSED_S=$limit
  run_step "$name" "$budget" "$limit"
  ok=$?
  unused=$(( limit > ELAPSED_S ? limit - ELAPSED_S : 0 ))
  if [ $ok -ne 0 ]; then
    failed=1
    if [ "$name" = environment ] && [ "$DRY" = 0 ]; then
      echo "no usable CUDA device: the other steps are skipped (benchmarks/gpu_check.sh --dry-run runs on the CPU)" >&2
      for rest in "${STEPS[@]:1}"; do
        mkdir -p "$OUT/$rest"
        printf '%s\tskipped\t0.0\t%s\t-\t-\n' "$rest" "${BUDGET_S[$rest]}" >> "$OUT/steps.tsv"
        echo "skipped: the environment step found no usable CUDA device" > "$OUT/$rest/figures.md"
      done
      break
    fi
  fi
done
"$PYTHON" benchmarks/gpu_check_report.py summary "$OUT" > /dev/null || failed=1
echo "summary: $OUT/summary.md"
exit $failed
