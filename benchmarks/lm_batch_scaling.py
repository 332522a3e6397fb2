"""The batch-scaling rules in the second regime: a GPT trained from text, its batch counted in tokens.

Does the lr rule the framework applies by default (AdamW: sqrt, as Malladi et al. 2022 derived for
Adam on language models) hold for a language model, and where does it break? One Hydra multirun of
`train.py` per lr rule (sqrt, linear, none): a 2-block GPT (width 64) on 1 MB of the built-in corpus
(the Python standard library's sources, 10% of its files held out for validation, byte-level BPE of
1,024 tokens, packed sequences of 64),
AdamW at lr 3e-3 and weight decay 0.1 given for 1,024 tokens, betas (0.9, 0.95), warmup 5% then
cosine, today's other defaults (percentile clipping, the non-finite guard, no decay on norms, biases
and embeddings); every job one epoch (the same tokens seen) at a global batch of 256 to 4,096 tokens,
over seeds.

The decision rule, fixed before the runs: the outcome is the final validation loss per token (the
log of the perplexity; lower is better). A rule *holds* at a batch when its mean differs from the
same rule's at the reference batch (1,024 tokens, where every rule gives the same lr) by less than
the noise, or is better: Welch's interval on the difference includes zero or lies below it. One rule
is *better or worse* than another at a batch only when that interval excludes zero. Every interval
is at 1 - 0.05/m confidence, m the number of comparisons the report makes (Bonferroni), so the
report as a whole keeps a 5% chance of one false difference. A difference inside the noise is called
that. How large a difference that rule can see with the seeds run (80% power, in standard deviations
of the seed spread, by the noncentral t distribution) is computed and printed with the verdicts: with
three seeds and the corrected level it is large, so "within the noise" here says only that no large
difference was seen.

Every job's numbers go into a jobs file (`<out>_jobs.json`, merged by setting and seed) with the
command, start, duration and machine of its sweep; the report is written from that file alone.

    python benchmarks/lm_batch_scaling.py                       # 3 rules x 5 batches x 3 seeds, ~20 min here
    python benchmarks/lm_batch_scaling.py --report-only         # the report from the jobs file
    python benchmarks/lm_batch_scaling.py --quick --out /tmp/lm.md   # CI: outputs only, about 30 s

Nothing else should run on the machine meanwhile (each sweep is one process, its jobs in sequence).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep_jobs import (add_jobs, keep_comparison, load_jobs, overrides_of, provenance_of, run_multirun,  # noqa: E402
                        summaries, write_report)

from trainer.infra.figures import new_figure, save_png  # noqa: E402
from trainer.measure.seed_groups import Spread, difference  # noqa: E402

SEQUENCE = 64
#: Sequences a device batch: x 64 tokens = 256 ... 4,096 tokens.
BATCHES = (4, 8, 16, 32, 64)
REFERENCE_TOKENS = 1024
RULES = ("sqrt", "linear", "none")
DEFAULT_RULE = "sqrt"
SEEDS = (0, 1, 2)
STUDY = ["task=language_model", "data=text", "model=gpt", "optimizer=adamw", "data.max_corpus_mb=1", "data.val_fraction=0.1",
         f"data.sequence_length={SEQUENCE}", "data.vocab_size=1024", "model.layers=2", "model.width=64",
         "model.heads=4", "optimizer.lr=0.003", "optimizer.weight_decay=0.1", f"optimizer.ref_batch_size={REFERENCE_TOKENS}",
         "optimizer.betas=[0.9,0.95]", "trainer.max_epochs=1", "objective=val/perplexity"]
KEY = ("rule", "tokens", "seed")


def job_of(summary: dict[str, Any], sweep: dict[str, Any]) -> dict[str, Any]:
    overrides = overrides_of(summary)
    metrics = summary.get("metrics") or {}
    completed = summary.get("status") == "completed"
    hyper = summary.get("hyperparameters") or {}
    return {"rule": overrides.get("optimizer.lr_scaling", DEFAULT_RULE),
            "tokens": int(hyper.get("global_batch_tokens") or int(overrides["data.batch_size"]) * SEQUENCE),
            "seed": int(overrides.get("seed", 42)), "status": summary.get("status"),
            "val_loss": metrics.get("val", {}).get("loss") if completed else None,
            "val_perplexity": metrics.get("val", {}).get("perplexity") if completed else None,
            "unigram": (summary.get("data") or {}).get("baselines", {}).get("val/perplexity"),
            "lr": hyper.get("lr"), "steps": summary.get("steps"),
            "tokens_per_s": (summary.get("throughput") or {}).get("tokens_per_s"),
            **provenance_of(summary), "sweep": sweep}


def run_study(rules: tuple[str, ...], batches: tuple[int, ...], seeds: tuple[int, ...], extra: list[str],
              out: Path, runs: Path) -> None:
    """One multirun per rule, its run folders under `runs`; each sweep's comparison.md kept beside
    the report (`<out>_sweeps/RULE.md`) and its jobs added to the jobs file."""
    for rule in rules:
        folder = runs / rule
        overrides = [*STUDY, f"optimizer.lr_scaling={rule}", f"data.batch_size={','.join(map(str, batches))}",
                     f"seed={','.join(map(str, seeds))}", *extra]
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        load = os.getloadavg()[0]
        seconds = run_multirun(overrides, folder, f"lr-{rule}")
        sweep = {"command": "python train.py -m " + " ".join(overrides), "started": started,
                 "sweep_s": round(seconds, 1), "load_before": round(load, 2), "host": platform.node()}
        add_jobs(jobs_file(out), [job_of(s, sweep) for s in summaries(folder)], lambda j: tuple(j[k] for k in KEY))
        keep_comparison(folder, out.parent / f"{out.stem}_sweeps", rule)
        print(f"{rule}: {seconds:.0f} s", flush=True)


def jobs_file(out: Path) -> Path:
    return out.parent / f"{out.stem}_jobs.json"


def losses(jobs: list[dict[str, Any]], rule: str, tokens: int) -> list[float]:
    return [j["val_loss"] for j in jobs if j["rule"] == rule and j["tokens"] == tokens and j["val_loss"] is not None]


def comparisons(jobs: list[dict[str, Any]]) -> list[tuple[str, int, str | None]]:
    """Every comparison the report makes: (rule, batch in tokens, the other rule or None for the
    rule's own reference batch)."""
    batches = sorted({j["tokens"] for j in jobs})
    rules = [r for r in RULES if any(j["rule"] == r for j in jobs)]
    made = [(rule, b, None) for rule in rules for b in batches if b != REFERENCE_TOKENS]
    made += [(DEFAULT_RULE, b, other) for other in rules if other != DEFAULT_RULE for b in batches if b != REFERENCE_TOKENS]
    return made


def detectable(seeds: int, alpha: float, power: float = 0.8) -> float | None:
    """The smallest difference (in standard deviations of the seed spread) that a two-sided
    two-sample t test at `alpha` with `seeds` runs a side finds with `power`."""
    if seeds < 2:
        return None
    from scipy.optimize import brentq
    from scipy.stats import nct, t

    df = 2 * seeds - 2
    critical = t.ppf(1 - alpha / 2, df)

    def shortfall(effect: float) -> float:
        return float(1 - nct.cdf(critical, df, effect * (seeds / 2) ** 0.5)) - power

    return float(brentq(shortfall, 0.01, 100))


def verdicts(jobs: list[dict[str, Any]]) -> list[str]:
    made = comparisons(jobs)
    confidence = 1 - 0.05 / max(1, len(made))
    seeds = min(len(losses(jobs, r, b)) for r, b, _ in made) if made else 0
    effect = detectable(seeds, 1 - confidence)
    sds = [s for s in (Spread.of(losses(jobs, r, b)).sd for r in RULES for b in {j["tokens"] for j in jobs}) if s]
    spread = sorted(sds)[len(sds) // 2] if sds else None
    lines = [f"Welch intervals at {confidence:.4f} confidence (Bonferroni over {len(made)} comparisons); "
             "the difference is in validation loss per token (nats), lower is better."]
    if effect is not None:
        lines.append(f"With {seeds} seeds a side at that level, a difference of {effect:.1f} standard deviations is found "
                     f"with 80% power" + (f" (the median seed spread is {spread:.3f} nats: {effect * spread:.3f} nats)"
                                          if spread else "") + ".")
    for rule in [r for r in RULES if any(j["rule"] == r for j in jobs)]:
        holds, parts = [], []
        for rule_, batch, other in made:
            if rule_ != rule or other is not None:
                continue
            found = difference(losses(jobs, rule, REFERENCE_TOKENS), losses(jobs, rule, batch), confidence)
            if found is None:
                continue
            parts.append(f"{batch:,}: {found.text('{:.3f}')}")
            if found.within_noise is True or (found.within_noise is False and found.value < 0):
                holds.append(batch)
        lines.append(f"- {rule}{' (default)' if rule == DEFAULT_RULE else ''}, against {REFERENCE_TOKENS:,} tokens: "
                     + "; ".join(parts) + f". Holds at: {', '.join(f'{b:,}' for b in holds) or 'no other batch'}")
    for other in [r for r in RULES if r != DEFAULT_RULE and any(j["rule"] == r for j in jobs)]:
        better, worse = [], []
        for batch in sorted({j["tokens"] for j in jobs} - {REFERENCE_TOKENS}):
            found = difference(losses(jobs, other, batch), losses(jobs, DEFAULT_RULE, batch), confidence)
            if found is not None and found.within_noise is False:
                (better if found.value < 0 else worse).append(f"{batch:,} ({found.value:+.3f})")
        lines.append(f"- {DEFAULT_RULE} against {other}: beyond the noise better at {', '.join(better) or 'no batch'}; "
                     f"worse at {', '.join(worse) or 'no batch'}; within it elsewhere")
    return lines


def table(jobs: list[dict[str, Any]]) -> list[str]:
    lines = ["| batch (tokens) | lr rule | lr | val loss (mean ± sd, n) | val perplexity (mean ± sd) | steps | tokens/s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for batch in sorted({j["tokens"] for j in jobs}):
        for rule in RULES:
            runs = [j for j in jobs if j["tokens"] == batch and j["rule"] == rule]
            if not runs:
                continue
            lines.append(f"| {batch:,} | {rule} | {runs[0]['lr']:.3g} | {Spread.of([j['val_loss'] for j in runs]).text('{:.3f}')} "
                         f"| {Spread.of([j['val_perplexity'] for j in runs]).text('{:.1f}')} | {runs[0]['steps']} "
                         f"| {Spread.of([j['tokens_per_s'] for j in runs]).text('{:,.0f}')} |")
    return lines


def report(out: Path) -> None:
    jobs = [j for j in load_jobs(jobs_file(out)) if j["status"] == "completed"]
    if not jobs:
        raise SystemExit(f"no completed jobs in {jobs_file(out)}")
    unigram = Spread.of([j["unigram"] for j in jobs]).text("{:.1f}")
    machines = sorted({j["machine"] for j in jobs})
    # Jobs written before each job kept its own provenance hold their sweep's fields at the top level.
    sweeps = sorted({(w["command"], w["started"], w["sweep_s"], w["load_before"], w["host"])
                     for w in (j.get("sweep") or j for j in jobs)})
    lines = ["# The batch-scaling rules on a language model", "",
             f"Written by `python benchmarks/lm_batch_scaling.py` from {jobs_file(out).name} ({len(jobs)} jobs on "
             f"{', '.join(machines)}). The decision rule is the script's docstring, fixed before the runs.",
             f"The unigram baseline of the validation split: perplexity {unigram}.", "", "## Verdicts", "",
             *verdicts(jobs), "", "## Every setting", "", *table(jobs), "", "## The sweeps", ""]
    lines += [f"- {started}, {seconds:.0f} s, load {load} before, on {host}: `{command}`"
              for command, started, seconds, load, host in sweeps]
    write_report(out, lines, lambda png: plot(jobs, png))


def plot(jobs: list[dict[str, Any]], path: Path) -> None:
    figure = new_figure(figsize=(6, 4), layout="constrained")
    axes = figure.subplots()
    for rule in RULES:
        batches = sorted({j["tokens"] for j in jobs if j["rule"] == rule and losses(jobs, rule, j["tokens"])})
        spreads = [Spread.of(losses(jobs, rule, b)) for b in batches]
        axes.errorbar(batches, [s.mean for s in spreads], yerr=[s.sd or 0 for s in spreads], marker="o", capsize=3,
                      label=f"{rule}{' (default)' if rule == DEFAULT_RULE else ''}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("global batch (tokens)")
    axes.set_ylabel("validation loss per token (mean ± sd)")
    axes.set_title("AdamW on a GPT: the lr rule as the batch grows")
    axes.legend()
    save_png(figure, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lm_batch_scaling.md")
    parser.add_argument("--runs", type=Path, default=None,
                        help="where the sweeps' run folders go (default: outputs/lm_batch_scaling/DATE_TIME)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="two batches, one seed, 3 steps: the outputs only (CI)")
    args = parser.parse_args(argv)
    if not args.report_only:
        started = time.monotonic()
        runs = args.runs or REPO / "outputs" / "lm_batch_scaling" / time.strftime("%Y-%m-%d_%H-%M-%S")
        if args.quick:
            run_study(("sqrt", "linear"), (8, 16), (0,),
                      ["trainer.max_steps=3", "+trainer.val_check_interval=3", "trainer.limit_val_batches=2"], args.out,
                      args.runs or args.out.parent / f"{args.out.stem}_runs")
        else:
            run_study(RULES, BATCHES, SEEDS, [], args.out, runs)
        print(f"study: {time.monotonic() - started:.0f} s")
    report(args.out)


if __name__ == "__main__":
    main()
