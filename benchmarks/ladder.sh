#!/usr/bin/env bash
# Run an optimization ladder (one Hydra multirun, one job per stage) and keep its comparison.
#
#   benchmarks/ladder.sh resnet18_cpu                 # CPU-sized: ResNet-18, 16x16 synthetic images, a few minutes on 2 cores
#   benchmarks/ladder.sh resnet50 data=synthetic 'data.shape=[3,224,224]' data.train_samples=76800   # one GPU
#   benchmarks/ladder_gpu.sh                          # the line above
#
# The multirun folder (every job's run folder, comparison.md, comparison.png) stays under
# outputs/multirun/; the comparison is copied to benchmarks/results/ladder_<name>.md/.png.
# LADDER_SWEEP_DIR and LADDER_RESULTS_DIR put them elsewhere (benchmarks/gpu_check.sh keeps both
# in its own results folder).
set -euo pipefail
cd "$(dirname "$0")/.."
ladder=${1:?usage: benchmarks/ladder.sh LADDER [override ...]   (LADDER: a file of conf/ladder/)}
shift
python=${PYTHON:-.venv/bin/python}
sweep=${LADDER_SWEEP_DIR:-"outputs/multirun/ladder_${ladder}_$(date +%Y-%m-%d_%H-%M-%S)"}
results=${LADDER_RESULTS_DIR:-benchmarks/results}
"$python" train.py -m "+ladder=${ladder}" progress=plain "hydra.sweep.dir=${sweep}" "$@"
mkdir -p "$results"
{
  echo "Command: \`benchmarks/ladder.sh ${ladder}${*:+ $*}\`"
  echo
  cat "${sweep}/comparison.md"
} > "${results}/ladder_${ladder}.md"
cp "${sweep}/comparison.png" "${results}/ladder_${ladder}.png"
echo "written: ${results}/ladder_${ladder}.md and .png (the whole multirun: ${sweep})"
