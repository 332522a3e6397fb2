"""Which of the reference recipe's own schedule flags reach the race's target soonest on the race's
folder and budget: each variant of `--variant` run for `--seeds`, interleaved, timed by the race's
rule (the first epoch whose validation is at or above `--target`, benchmarks/time_to_accuracy.py),
before the race, so that the race gives the reference its best options for the budget. Writes a
markdown table and the raw JSON; prints the winning variant's flags (lowest mean time, a miss
counting as the whole training time) on its last line.

    python benchmarks/reference_options.py --out benchmarks/results/time_to_accuracy_reference_options_cpu.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from time_to_accuracy import (REPO, reference_command, reference_result, run_job,  # noqa: E402
                              usable_cpus, write_digits_folder)

VARIANTS = ("--lr-scheduler cosineannealinglr --lr-warmup-epochs 1 --lr-warmup-method linear --lr-warmup-decay 0.01 "
            "--label-smoothing 0.1",
            "--lr-scheduler cosineannealinglr --label-smoothing 0.1")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", help="reference flags to try (repeat); default: warmup + cosine, cosine")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "time_to_accuracy_reference_options_cpu.md")
    args = parser.parse_args(argv)
    variants = args.variant or list(VARIANTS)
    limit = usable_cpus() + 0.5
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "digits_jpeg"
        write_digits_folder(root)
        for seed in (int(s) for s in args.seeds.split(",")):
            for flags in variants:
                job, stdout = run_job(reference_command(root, args.epochs, 1, seed, flags), limit, 20.0)
                found = reference_result(stdout, args.target)
                runs.append({**job, "flags": flags, "seed": seed, "time_s": found["time_s"], "epoch": found["epoch"],
                             "whole_s": found["train_s"], "final_acc": found["final_val_acc"]})
    means = {flags: statistics.fmean(r["time_s"] if r["time_s"] is not None else r["whole_s"]
                                     for r in runs if r["flags"] == flags) for flags in variants}
    best = min(means, key=means.get)
    lines = [f"# The reference's options for the race (target val acc {args.target}, {args.epochs} epochs)", "",
             f"`python benchmarks/reference_options.py {' '.join(argv if argv is not None else sys.argv[1:])}`: "
             "every variant for every seed, interleaved; time to target by the race's rule (a miss counts as the "
             "whole training time in the mean). Chosen for the race: the lowest mean.", "",
             "| flags | seed | time to target (s) | epoch | final val acc | load start-end | beside other load |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in runs:
        lines.append(f"| `{r['flags']}` | {r['seed']} | {r['time_s'] if r['time_s'] is not None else 'missed'} | "
                     f"{r['epoch'] or '-'} | {r['final_acc']:.3f} | {r['load_start']:.2f}-{r['load_end']:.2f} | "
                     f"{r['beside_other_load']} |")
    lines += ["", *(f"- mean `{flags}`: {mean:.1f} s" + (" (**chosen**)" if flags == best else "")
                    for flags, mean in means.items())]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs, "means": means, "chosen": best}, indent=1, default=str))
    print("\n".join(lines))
    print(best)


if __name__ == "__main__":
    main()
