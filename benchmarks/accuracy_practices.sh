#!/usr/bin/env bash
# The accuracy practices, one at a time, on the CPU-sized ViT recipe (recipes/vit_tiny_digits.yaml):
# two multiruns with a time-to-accuracy target, their comparison tables kept together.
#
#   benchmarks/accuracy_practices.sh            # about 3 minutes on 2 cores
#
# 1. regularization=off,label_smoothing,mixup_cutmix (the recipe's own choice is label_smoothing);
# 2. model.drop_path_rate=0,0.1 x callbacks=none,ema (stochastic depth and EMA, and both);
# 3. callbacks=ema with callbacks.ema.decay=0.99,0.95 (the default 0.999 averages over ~1,000 steps,
#    longer than this 380-step run).
# Every job is one seeded run: differences of a few hundredths of accuracy are within seed noise.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
stamp=$(date +%Y-%m-%d_%H-%M-%S)
out=${RESULTS:-benchmarks/results/accuracy_practices_vit_digits.md}
target=(target.metric=val/acc target.value=0.85 progress=plain)
"$python" train.py -m +recipe=vit_tiny_digits regularization=off,label_smoothing,mixup_cutmix "${target[@]}" \
  "hydra.sweep.dir=outputs/multirun/accuracy_regularization_${stamp}"
"$python" train.py -m +recipe=vit_tiny_digits model.drop_path_rate=0,0.1 callbacks=none,ema "${target[@]}" \
  "hydra.sweep.dir=outputs/multirun/accuracy_depth_ema_${stamp}"
"$python" train.py -m +recipe=vit_tiny_digits callbacks=ema callbacks.ema.decay=0.99,0.95 "${target[@]}" \
  "hydra.sweep.dir=outputs/multirun/accuracy_ema_decay_${stamp}"
{
  echo "Command: \`benchmarks/accuracy_practices.sh\` ($(date -u +%Y-%m-%d), $(nproc) CPUs)"
  for sweep in "accuracy_regularization_${stamp}" "accuracy_depth_ema_${stamp}" "accuracy_ema_decay_${stamp}"; do
    echo
    sed -n '1,/^## Details/p' "outputs/multirun/${sweep}/comparison.md" | sed '$d'
  done
} > "$out"
echo "written: $out"
