#!/usr/bin/env bash
# The one prepared GPU check: the first thing to run whenever a GPU machine is lent. At most 7
# minutes (420 s) on one H200 with 16 CPU cores, interpreter starts and torch.compile included, so
# that one 15-minute lease can run it twice; the framework against a hand-written loop comes first.
#
#   benchmarks/gpu_check.sh                 # on a CUDA machine; results in benchmarks/results/gpu/<UTC date>/
#   benchmarks/gpu_check.sh --out DIR       # results in DIR
#   benchmarks/gpu_check.sh --steps a,b,c   # only these steps, in this order (e.g. ceiling)
#   benchmarks/gpu_check.sh --dry-run       # every step for a few iterations on the CPU, tiny model
#                                           # and images (CI runs it: tests/run/test_gpu_check.py);
#                                           # results in outputs/gpu_check_dry_run/ unless --out
#
# Each step is a function step_NAME run under its own time budget (seconds, below), plus whatever
# the steps before it left unused, so the whole check stays within the sum of the budgets: a step
# that overruns is stopped and recorded as timed out, a step that fails is recorded as failed, and
# the next step runs either way. Every step writes into RESULTS/NAME/ (its log in step.log) as soon
# as it ends, and its key figures into RESULTS/NAME/figures.md, the first line the key figure
# (benchmarks/gpu_check_report.py reads them from the step's files, also after a failure);
# RESULTS/summary.md opens with the overhead step's ratios, then lists each step, its status,
# duration and key figures. The exit status is 1 if any step failed, 2 on a usage error. The
# ResNet-50 runs are benchmarks/practices.py's GPU base: 224 px device-made images, batch 128, bf16,
# TF32, channels_last, fused SGD, no compile. The default steps, in order:
#
#   environment  nvidia-smi output, torch / CUDA / cuDNN versions, the devices, the framework's fingerprint
#   overhead     benchmarks/gpu_overhead.py: the framework's loop against the hand-written loop
#                (benchmarks/hand_loop.py) on the same network, batch, optimizer, precision and kernels,
#                both timed by the same code, 3 interleaved repeats: framework/loop for ResNet-50 and GPT-2
#                small, eager and compiled, against the goal >= 0.98x; the ResNet-50 eager row also prices
#                the framework's default clipping + non-finite guard (what step_cost measures with train.py)
#   data_stage   benchmarks/data_stage.py: ResNet-50 on ~7,000 JPEG files (2,048 distinct 500x375
#                photos): the step alone, the loader alone per decode mode and end to end (decode=fast
#                with and without the copy overlap, decode=device), each timed after the loader's
#                prefetch queue drained: input-bound or compute-bound, with the GPU's utilisation
#   gpu_tests    pytest -m gpu over tests/gpu/: junit.xml and pytest.log
#
# Only with --steps: they do not fit the 420 s beside the steps above (their durations on the first
# H200 run in brackets, or estimated), so they are kept for when they are asked:
#   ceiling      benchmarks/gpu_ceiling.py: a short search (eager batch and memory format, then compile
#                default, reduce-overhead, max-autotune-no-cudagraphs) for ResNet-50 and GPT-2 small with
#                the hand loop: the fastest setting, its img/s or tokens/s and MFU, against the goals
#                (ResNet-50 >= 5,500 img/s, GPT-2 small >= 45% MFU); six compiles of tens of seconds and
#                max-autotune's autotuning: ~450 s, a call of its own (`--steps ceiling`)
#   step_cost    the default step's sync cost with whole train.py runs: practices.py's "clipping +
#                non-finite guard, decided on the device" row, on/off interleaved over 2 repeats (67 s;
#                the overhead step's defaults/bare column measures the same in process)
#   ladder       the ResNet-50 ladder (benchmarks/ladder_gpu.sh) shortened to 16 steps of batch 128 per
#                stage, no validation; ladder_mfu.md: img/s, speed-up and MFU per stage (102 s)
#   practices    the other practices.py --preset gpu rows: bf16 vs fp32, TF32 on/off, channels_last,
#                fused vs foreach (103 s)
#   reduce_overhead  compile=reduce_overhead (CUDA graphs) against compile=default (runs.md; its first
#                run alone took 40 s)
#   fsdp         trainer=fsdp trainer.devices=1 against the default strategy: samples/s, peak memory
#                (or the framework's refusal, which is then the row's figure; its first run took 30 s)
#   profile_memory  profile=true (ops.md and profile.json by category, the NVTX line) and
#                memory_plan=true (summary.json's memory_plan, memory_plan.png) on the base (the profile
#                alone took 30 s)
#   gpt          +recipe=gpt_small shortened: 26 steps eager on 2 MB of the standard library's sources:
#                tokens/s and MFU (runs.md; 18 s; the overhead step's gpt_small rows measure it too)
#   input_pipeline  benchmarks/input_pipeline.py --device-side: images per host core per decode mode,
#                and the device mode's batched nvjpeg decode + crop on the GPU (input_pipeline.md)
#   progressive_resize  benchmarks/progressive_resize.py: ResNet-50's step samples/s at each size of
#                progressive resizing's default 224 px schedule (128-224 px), beside the fast loader's
#                images per host core at that size, and the schedule's expected time against all-224
#                (progressive_resize.md)
#   batch_study  benchmarks/batch_scaling_gpu.py: the first GPU regime of the batch study, designed under
#                trainer/measure/decision_rule.py and committed before its first job: ResNet-18 on the
#                28 px expanded digits, AdamW's sqrt rule against none at batches 512 and 4,096, seed by
#                seed while 330 s allow (at least 2 for a paired test), verdict by the rule
#                (batch_scaling_gpu.md; a 6-minute lease: `--steps batch_study`)
#   encoder_kernels  benchmarks/encoder_kernels.py --device cuda: the encoder's fused against unfused
#                QKV and its FFN eager against compiled at lengths 128 and 512 (bf16, batch 32), and
#                compile's dynamic None/true on an epoch of bucketed batches with their recompiles
#                (encoder_kernels.md; estimated 4-5 min, not yet run on a GPU)
#   serve_text   the tiny encoder recipe and a tiny GPT trained on the GPU, exported, served and
#                load-tested: P50/P90/P99 and QPS by length bin and concurrency, time to first token
#                and per token, RSS/PSS (deploy_load_encoder.md, deploy_load_gpt.md; estimated 3 min)
#
# A later step is a function step_NAME plus its budgets in BUDGET_S and DRY_BUDGET_S, its name in
# STEPS or EXTRA_STEPS (and, for key figures, a reader in benchmarks/gpu_check_report.py). Keep the
# sum of the default steps' BUDGET_S within 400 s (420 s with the 5 s each step may take to stop).
set -uo pipefail

STEPS=(environment overhead data_stage gpu_tests)
EXTRA_STEPS=(ceiling step_cost ladder practices reduce_overhead fsdp profile_memory gpt input_pipeline
             progressive_resize batch_study encoder_kernels serve_text)
# Seconds per step on one H200, from the first run's durations (benchmarks/results/gpu/, 2026-12-04:
# environment 4.3 s, ladder 101.6, gpt 18.0, step_cost 66.6, gpu_tests 80.9, data_stage 61.8,
# practices 103.2; reduce_overhead, fsdp and profile_memory stopped at 40, 30 and 30 s after their
# first run) with a margin of about a fifth, and estimates for the steps that have not run yet:
# - overhead one interpreter (~8 s); 15 fits of the framework's Trainer (~2 s each: its start, the
#   loader's workers, Lightning's teardown moving the network to the CPU and back) and 27 runs of 36
#   steps (~30-35 ms a step: ~1.2 s each); four builds (~2 s each) and the 6 MB corpus tokenized once
#   (~8 s); the compiled rows' one compile each, shared by both sides (ResNet-50 ~35 s cold, as the
#   ladder's two compiles took ~60 s; GPT-2 small ~45 s): ~175 s.
# - data_stage one interpreter, 2,048 photos written by 16 processes (~5 s) and linked to ~7,000
#   files, the step alone (~5 s), then per row the folder's scan (~1 s), the loader alone (~52 batches,
#   the workers' start) and the fit (~52 steps): ~50 s.
# - ceiling eager settings ~5 s each, then six compiles (default and reduce-overhead ~40 s each from a
#   cold cache, max-autotune-no-cudagraphs' autotuning a few minutes): ~450 s.
# 400 s in all for the default steps (the --steps-only ones not counted), plus at most 5 s per step
# to stop one that overruns.
declare -A BUDGET_S=([environment]=10 [overhead]=210 [data_stage]=70 [gpu_tests]=110
                     [ceiling]=540 [step_cost]=80 [ladder]=120 [practices]=125 [reduce_overhead]=90 [fsdp]=60
                     [profile_memory]=70 [gpt]=25 [input_pipeline]=25 [progressive_resize]=20 [batch_study]=360
                     [encoder_kernels]=330 [serve_text]=240)
# These only stop a hung step of the dry run (about 70 s for the default steps on 2 CPU cores, ~10 s
# of each step the interpreter's imports; the --steps-only ones ~190 s more).
declare -A DRY_BUDGET_S=([environment]=40 [overhead]=120 [data_stage]=90 [gpu_tests]=90 [ceiling]=120
                         [step_cost]=90 [ladder]=120 [practices]=120 [reduce_overhead]=90 [fsdp]=90
                         [profile_memory]=90 [gpt]=90 [input_pipeline]=90 [progressive_resize]=90
                         [batch_study]=120 [encoder_kernels]=240 [serve_text]=300)

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

caller_dir=$PWD
cd "$(dirname "$0")/.." || exit 2
DRY=0
OUT=""
CHOSEN=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) [ $# -ge 2 ] || { echo "error: --out needs a folder" >&2; exit 2; }; OUT=$2; shift ;;
    --out=*) OUT=${1#--out=} ;;
    --steps) [ $# -ge 2 ] || { echo "error: --steps needs a list, e.g. ladder,gpt" >&2; exit 2; }; CHOSEN=$2; shift ;;
    --steps=*) CHOSEN=${1#--steps=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1'; allowed: --dry-run, --out DIR, --steps a,b,c" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$CHOSEN" ]; then
  IFS=, read -r -a STEPS <<< "$CHOSEN"
  for name in "${STEPS[@]}"; do
    if [ -z "${BUDGET_S[$name]+x}" ]; then
      echo "error: --steps: no step '$name'; the steps: ${!BUDGET_S[*]}" >&2
      exit 2
    fi
  done
fi
if [ -z "$OUT" ]; then
  # A dated folder: each lease's results sit beside the earlier ones (benchmarks/results/gpu/2026-12-04/).
  if [ "$DRY" = 1 ]; then OUT=outputs/gpu_check_dry_run; else OUT=benchmarks/results/gpu/$(date -u +%Y-%m-%d); fi
elif [[ "$OUT" != /* ]]; then
  OUT="$caller_dir/$OUT"
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "error: --out: cannot create '$OUT'" >&2; exit 2; }
# Every Python command of every step goes through $PYTHON (scripts invoked by path, ladder.sh too):
# tests/run/test_gpu_check.py sets it to tests/fork_server.py's stand-in, which forks each command from
# the pytest worker that has imported torch and Lightning already (the dry run's CPU is then the steps'
# own, not ~10 interpreter starts); a new step keeps to "$PYTHON" for the same reason.
PYTHON=${PYTHON:-.venv/bin/python}
export OUT DRY PYTHON
if [ "$DRY" = 1 ]; then
  # Tiny models on a shared CPU: one thread each is several times faster than torch's default
  # (one per core), whose threads spin while other processes hold the cores.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
# Fresh records only: a stale file from an earlier check must not pass for this one's.
for name in "${STEPS[@]}"; do rm -rf "${OUT:?}/$name"; done
if [ -z "$CHOSEN" ]; then for name in "${EXTRA_STEPS[@]}"; do rm -rf "${OUT:?}/$name"; done; fi
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

# The dry run's stand-in for the ResNet-50 base (benchmarks/practices.py's GPU base): the small CNN
# on 8 px device-made images, on the CPU, 8 steps; its numbers mean nothing, the files' making is tested.
tiny_base() {
  TINY=(model=small_cnn 'data.shape=[3,8,8]' data.num_classes=10 data.batch_size=4 data.train_samples=32
        data.val_samples=4 data.test_samples=4 trainer.accelerator=cpu)
}

step_step_cost() {
  local dir="$OUT/step_cost" size=(--run-timeout 60)
  # In the dry run in this interpreter (no import per run).
  [ "$DRY" = 1 ] && { tiny_base; size=(--in-process --base "${TINY[@]}"); }
  "$PYTHON" benchmarks/practices.py --preset gpu --only "clipping + non-finite" --repeats 2 \
    --out "$dir/practices.md" --json "$dir/practices.json" --runs-dir "$dir/runs" "${size[@]}"
}

step_practices() {
  local dir="$OUT/practices" size=(--run-timeout 60)
  [ "$DRY" = 1 ] && { tiny_base; size=(--in-process --base "${TINY[@]}"); }
  # The step cost's row is step_cost's; compile's is the ladder's and reduce_overhead's.
  "$PYTHON" benchmarks/practices.py --preset gpu --skip "clipping + non-finite" "torch.compile" --repeats 1 \
    --out "$dir/practices.md" --json "$dir/practices.json" --runs-dir "$dir/runs" "${size[@]}"
}

# check_runs DIR [check_runs.py arguments]: named train.py runs side by side, in DIR/runs.md and
# runs.json, on the ResNet-50 base (the dry run: on the tiny one, in this interpreter).
check_runs() {
  local dir=$1 size=(--base-preset gpu --run-timeout 90)
  shift
  [ "$DRY" = 1 ] && { tiny_base; size=(--base-preset gpu --in-process --base "${TINY[@]}"); }
  "$PYTHON" benchmarks/check_runs.py --out "$dir/runs.md" --json "$dir/runs.json" --runs-dir "$dir/runs" \
    "${size[@]}" "$@"
}

step_data_stage() {
  local dir="$OUT/data_stage" size=()
  [ "$DRY" = 1 ] && size=(--quick)
  "$PYTHON" benchmarks/data_stage.py --out "$dir/data_stage.md" --json "$dir/data_stage.json" --runs-dir "$dir/runs" \
    "${size[@]}"
}

# The text corpus's tokens, shared by the steps that train GPT-2 small (tokenized once a machine).
TEXT_CACHE="${TMPDIR:-/tmp}/gpu_check_text_cache"

step_overhead() {
  local dir="$OUT/overhead" size=()
  # The dry run: the small CNN and a one-block GPT on the CPU, compile=off standing in for compile=default.
  [ "$DRY" = 1 ] && size=(--quick --rows resnet50_eager,gpt_small_compiled)
  "$PYTHON" benchmarks/gpu_overhead.py --out "$dir/overhead.md" --json "$dir/overhead.json" --runs-dir "$dir/runs" \
    --cache-dir "$TEXT_CACHE" "${size[@]}"
}

step_ceiling() {
  local dir="$OUT/ceiling" size=()
  [ "$DRY" = 1 ] && size=(--quick)
  "$PYTHON" benchmarks/gpu_ceiling.py --out "$dir/ceiling.md" --json "$dir/ceiling.json" --runs-dir "$dir/runs" \
    --cache-dir "$TEXT_CACHE" "${size[@]}"
}

step_reduce_overhead() {
  local dir="$OUT/reduce_overhead" default=compile=default reduce=compile=reduce_overhead
  # On the CPU Inductor's compile takes minutes of the dry run: compile=auto (eager there) stands
  # in for both modes, and the table says so in its overrides.
  [ "$DRY" = 1 ] && { default=compile=auto; reduce=compile=auto; }
  check_runs "$dir" --show compile,precision --run default "$default" --run reduce_overhead "$reduce"
}

step_fsdp() {
  local dir="$OUT/fsdp"
  # The framework refuses trainer=fsdp without CUDA (the dry run): that refusal is then the row.
  check_runs "$dir" --show precision,compile --run default "" --run fsdp "trainer=fsdp trainer.devices=1" \
    --may-refuse fsdp
}

step_profile_memory() {
  local dir="$OUT/profile_memory" steps=""
  # The profile keeps profile_steps after 3 skipped and 2 warm-up steps: the dry run's 8 steps fit 2.
  [ "$DRY" = 1 ] && steps=" profile_steps=2"
  check_runs "$dir" --show precision,compile --run profile "profile=true$steps" --run memory_plan "memory_plan=true"
}

step_gpt() {
  local dir="$OUT/gpt" cache="$TEXT_CACHE"
  # 26 steps: 5 warm-up, two 10-step windows; eager (compile=auto would compile GPT-2 small for about
  # a minute, more than the step's budget); 2 MB of the standard library's sources (~0.6 M tokens).
  local run=(+recipe=gpt_small compile=off data.max_corpus_mb=2 "data.cache_dir=$cache" trainer.max_epochs=1
             trainer.limit_train_batches=26 trainer.limit_val_batches=0 trainer.limit_test_batches=0
             trainer.num_sanity_val_steps=0 checkpointing=off progress=off logger=csv)
  local size=(--run-timeout 90)
  if [ "$DRY" = 1 ]; then
    # Half a megabyte: 20 documents, a quarter each held out so that val and test have one.
    run+=(data.max_corpus_mb=0.5 data.val_fraction=0.25 data.test_fraction=0.25 data.vocab_size=300
          data.sequence_length=32 data.batch_size=4 data.num_workers=0 model.layers=1 model.width=32 model.heads=2
          trainer.limit_train_batches=8 trainer.accelerator=cpu)
    size=(--in-process)
  fi
  "$PYTHON" benchmarks/check_runs.py --out "$dir/runs.md" --json "$dir/runs.json" --runs-dir "$dir/runs" \
    --show precision,compile,global_batch_tokens "${size[@]}" --run gpt_small "${run[*]}"
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
  local dir="$OUT/batch_study" dry=()
  # The dry run: the same design's code on the CPU at a tenth of the size (batch_scaling_gpu.py's "dry").
  [ "$DRY" = 1 ] && dry=(--dry-run)
  "$PYTHON" benchmarks/batch_scaling_gpu.py "${dry[@]}" --out "$dir/batch_scaling_gpu.md" --runs "$dir/runs"
}

step_encoder_kernels() {
  local args=(--device cuda --rounds 5 --round-s 0.5 --dynamic None,true)
  [ "$DRY" = 1 ] && args=(--quick)
  "$PYTHON" benchmarks/encoder_kernels.py "${args[@]}" --out "$OUT/encoder_kernels/encoder_kernels.md"
}

# serve_text: train, export, serve and load each text model (trainer/deploy; docs/deploy.md).
step_serve_text() {
  local dir="$OUT/serve_text" on=(trainer.accelerator=gpu) device=(--device cuda) short=()
  [ "$DRY" = 1 ] && on=(trainer.accelerator=cpu) device=()
  local status=0 name recipe
  for name in encoder gpt; do
    recipe=encoder_tiny_text
    [ "$DRY" = 1 ] && short=(trainer.max_steps=10 trainer.limit_val_batches=4)
    if [ $name = gpt ]; then
      recipe=gpt_tiny_text
      [ "$DRY" = 1 ] && short=(trainer.max_steps=10 trainer.val_check_interval=10 trainer.limit_val_batches=4)
    fi
    "$PYTHON" train.py +recipe=$recipe "${on[@]}" "${short[@]}" progress=off "hydra.run.dir=$dir/$name" \
      "data.cache_dir=$dir/cache_$name" > "$dir/train_$name.log" 2>&1 &&
      "$PYTHON" -m trainer.deploy export "$dir/$name" &&
      "$PYTHON" -m trainer.deploy load "$dir/$name" "${device[@]}" --concurrency 1,8 --requests 300 \
        --budget-s 8 || status=1
    cp "$dir/$name/deploy_load.md" "$dir/deploy_load_$name.md" 2>/dev/null
  done
  return $status
}

export TEXT_CACHE
export -f step_environment step_overhead step_ceiling step_step_cost step_ladder step_data_stage step_gpu_tests \
  step_practices step_reduce_overhead step_fsdp step_profile_memory step_gpt step_input_pipeline \
  step_progressive_resize step_batch_study step_encoder_kernels step_serve_text tiny_base check_runs

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
  "$([ "$DRY" = 1 ] && echo ' --dry-run')${CHOSEN:+ --steps $CHOSEN}" "$PYTHON" > "$OUT/run.json"
failed=0
unused=0  # seconds the steps so far left of their budgets: the next step may use them
for index in "${!STEPS[@]}"; do
  name=${STEPS[$index]}
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
      for rest in "${STEPS[@]:$((index + 1))}"; do
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
