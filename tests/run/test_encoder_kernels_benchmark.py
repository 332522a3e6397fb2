"""benchmarks/encoder_kernels.py at its smallest (--quick), as CI runs it (in a forked child: it traces
with Dynamo, tests.helpers.in_forked_child says why). Its times mean nothing on a shared CPU; what is
asserted is what does not depend on load: a row per variant with positive times, fused's ratio to
itself 1.00, every variant's logits equal to fused's, the provenance; and Dynamo's frames on the
bucketed batches as its rules give them: none eager, one a shape with dynamic=false until the recompile
limit (then eager, and said so), one graph with dynamic=true (plus one for a batch of one sequence,
which Dynamo specialises), torch's automatic dynamic shapes a static graph then a dynamic one."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import benchmark, in_forked_child

NUMBER = r"[\d,]+(?:\.\d+)?"
VARIANTS = ("fused", "unfused", "fused, FFN compiled")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    folder = tmp_path_factory.mktemp("encoder_kernels")
    out = folder / "encoder_kernels.md"
    argv = ["--quick", "--cache-dir", str(folder / "cache"), "--out", str(out)]
    in_forked_child(lambda: benchmark("encoder_kernels").main(argv), timeout=400)
    return out.read_text(), json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow
@pytest.mark.run
def test_the_kernel_table_has_a_row_per_variant_with_equal_logits(quick):
    text, record = quick
    assert "`python benchmarks/encoder_kernels.py --quick" in text
    assert re.search(rf"started \S+, \d+ s; load average {NUMBER} at the start, {NUMBER} at the end", text)
    assert record["threads"] == 1 and record["precision"] == "fp32" and record["backend"] == "eager"
    (case,) = record["cases"]
    assert (case["length"], case["batch"], case["layers"], case["width"]) == (128, 8, 2, 128)
    assert list(case["times_s"]) == list(VARIANTS)
    for variant in VARIANTS:
        row = re.search(rf"^\| encoder_tiny_text \(2 x 128, 4 heads\) \| 128 \| 8 \| {re.escape(variant)} \| "
                        rf"({NUMBER}) \({NUMBER}-{NUMBER}\) \| ({NUMBER}) \| \*\*({NUMBER}) \({NUMBER}-{NUMBER}\)x\*\* \| "
                        rf"({NUMBER}) \| (\S+) \|$", text, re.MULTILINE)
        assert row, (variant, text)
        ms, positions, ratio, first = (float(row.group(i).replace(",", "")) for i in range(1, 5))
        assert ms > 0 and first > 0
        assert positions == pytest.approx(8 * 128 / (ms / 1e3), rel=0.01)
        assert ratio == pytest.approx(case["ratios"][variant][0], abs=0.006)
        assert case["logit_difference"][variant] < 1e-5, case["logit_difference"]
    assert case["ratios"]["fused"] == [1.0] and case["logit_difference"]["fused"] == 0.0


@pytest.mark.slow
@pytest.mark.run
def test_the_recompiles_on_bucketed_batches_follow_dynamos_rules(quick):
    text, record = quick
    dynamic = record["dynamic"]
    rows = {row["dynamic"]: row for row in dynamic["rows"]}
    assert list(rows) == ["eager", "None", "false", "true"]
    lengths, sizes, limit = dynamic["lengths"], dynamic["rows_per_batch"], dynamic["recompile_limit"]
    assert len(lengths["train"]) == 16 and all(length % 8 == 0 for length in lengths["train"] + lengths["val"])
    assert len(set(lengths["train"])) > 2 and set(sizes["train"]) == {8}
    frames = {name: (row["train"]["frames_compiled"], row["val"]["frames_compiled"]) for name, row in rows.items()}
    assert frames["eager"] == (0, 0) and rows["eager"]["recompiles"] == 0
    # dynamic=false: a graph per shape (validation's again: Dynamo guards on grad mode), up to the limit.
    shapes = len(set(lengths["train"])) + len(set(zip(sizes["val"], lengths["val"])))
    assert sum(frames["false"]) == min(shapes, limit) and rows["false"]["recompile_limit_hit"] == (shapes > limit)
    assert frames["false"][0] == min(len(set(lengths["train"])), limit)
    one_row = int(1 in sizes["val"])  # a batch of one sequence: Dynamo specialises a dimension of size 1
    assert frames["true"] == (1, 1 + one_row) and not rows["true"]["recompile_limit_hit"]
    assert frames["None"][0] == 2 and frames["None"][1] <= 1 + one_row + 1
    for name, row in rows.items():
        assert row["recompiles"] == max(0, sum(frames[name]) - 1)
        assert row["train"]["graph_breaks"] == 0 and row["train"]["compiling_steps"] <= row["train"]["frames_compiled"]
        assert row["train"]["steps"] == 16 and row["train"]["total_s"] > 0
    assert dynamic["null_resolves_to"] == "true"
    assert re.search(r"^\| false \| \d+ / \d+ \| \d+ \| (yes|no) \|", text, re.MULTILINE)
    assert f"| true (what null resolves to here: true) | 1 / {1 + one_row} | {1 + one_row} | no |" in text
