#!/usr/bin/env bash
# What clipping and the non-finite guard cost the default run's small steps on this machine, for one
# or more checkouts side by side: each repeat runs every tree with the two defaults on, then off,
# interleaved, 3 epochs of the default digits training; prints one line per run (repeat | tree | arm |
# samples/s from summary.json's throughput). The step is tiny (~30 ms on 2 cores), so the per-step
# work of the two defaults shows here as it does not on a real model (benchmarks/practices.py).
#
#   benchmarks/step_cost_digits.sh [REPEATS] [TREE ...]     # trees default to this checkout
#   git worktree add /tmp/before <commit> && ln -s $PWD/.venv /tmp/before/.venv
#   benchmarks/step_cost_digits.sh 5 /tmp/before .          # before and after, interleaved
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-3}
shift || true
trees=("$@")
[ ${#trees[@]} -eq 0 ] && trees=(.)
here=$PWD
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$repeats"); do
  for tree in "${trees[@]}"; do
    for arm in "clipping=percentile nonfinite=skip" "clipping=off nonfinite=off"; do
      rm -rf "$out/run"
      # shellcheck disable=SC2086
      (cd "$tree" && "$here/.venv/bin/python" train.py $arm trainer.max_epochs=3 checkpointing=off progress=off \
        run.root="$out/run" > /dev/null 2>&1)
      summary=$(find "$out/run" -name summary.json | head -1)
      rate=$("$here/.venv/bin/python" -c "import json,sys; print(round(json.load(open(sys.argv[1]))['throughput']['samples_per_s'], 1))" "$summary")
      echo "$r|$tree|$arm|$rate"
    done
  done
done
