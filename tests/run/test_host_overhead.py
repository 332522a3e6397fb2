"""benchmarks/host_overhead.py --quick: the benchmark runs end to end (every section of its results
file written from its record), and what it counts rather than times holds: the operations and
Python calls a framework step adds beyond bare Lightning do not grow with the number of parameter
tensors, and stay a handful (the non-finite guard, the clipping, the training metrics: about 25
operations, where the guard and the clipping alone were about 100 before they were cut), and the
framework's Trainer makes fewer Python calls a step than bare Lightning (its lean hook calls). The times
themselves are the benchmark's to report, not a test's to assert."""

from __future__ import annotations

import json

import pytest

from tests.helpers import benchmark

pytestmark = [pytest.mark.run, pytest.mark.slow]

#: Ceilings a little above today's counts (22.2 operations beyond bare Lightning on the CPU with the
#: default fused AdamW, whose kernel applies the clipping's factor; 25.2 with a foreach optimizer; 440
#: Python calls fewer than bare Lightning, Lightning 2.6's hook calls made lean:
#: trainer/infra/lean_lightning.py): work added to every step shows here first.
MAX_OPS_BEYOND_LIGHTNING = 25
MAX_CALLS_BEYOND_LIGHTNING = -350


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    host_overhead = benchmark("host_overhead")
    out = tmp_path_factory.mktemp("host_overhead") / "host_overhead.md"
    assert host_overhead.main(["--quick", "--out", str(out)]) == 0
    return json.loads(out.with_suffix(".json").read_text()), out.read_text()


def test_the_framework_step_adds_a_fixed_handful_of_operations_and_calls(record):
    ops = record[0]["ops"]
    small, deep = ops.values()
    assert (small["parameter_tensors"], deep["parameter_tensors"]) == (8, 38)
    # Flat: the same per-step average for both networks (counts over the same steps, to float rounding).
    assert small["added"] == pytest.approx(deep["added"], abs=1e-6)
    assert small["added_beyond_lightning"] == pytest.approx(deep["added_beyond_lightning"], abs=1e-6)
    assert 0 < small["added_beyond_lightning"] <= MAX_OPS_BEYOND_LIGHTNING
    beyond = [o["calls"]["framework"] - o["calls"]["lightning"] for o in (small, deep)]
    assert beyond[0] == beyond[1] and beyond[0] <= MAX_CALLS_BEYOND_LIGHTNING
    # The loop's own operations do grow with the network (its forward, backward and step): the count sees them.
    assert deep["loop"] > small["loop"] + 100


def test_the_results_file_has_every_section_with_the_machine_and_the_command(record):
    data, text = record
    assert set(data["times"]) == {"loop", "lightning", "framework", "framework clipping=off",
                                  "framework nonfinite=off"}
    assert all(len(runs) == 1 and runs[0]["cpu_us"] > 0 for runs in data["times"].values())
    assert data["machine"]["torch"] and data["command"].startswith("python benchmarks/host_overhead.py --quick")
    assert data["load_at_start"] >= 0 and data["started"] and data["duration_s"] > 0
    for heading in ("## Microseconds per step", "## The framework's extra time per step, by source",
                    "## Operations per step"):
        assert heading in text
    assert "the goal, within 250 us:" in text and "flat in the number of parameter tensors" in text
    assert set(data["sources"]) >= {"the non-finite guard", "clipping", "callback dispatch"}


def test_the_optimizer_kernel_benchmark_times_each_kernel(tmp_path):
    optimizer_kernels = benchmark("optimizer_kernels")
    out = tmp_path / "kernels.md"
    assert optimizer_kernels.main(["--rounds", "1", "--steps", "2", "--networks", "host-overhead network (8 tensors)",
                                   "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| host-overhead network")]
    assert [row.split(" | ")[3] for row in rows] == ["AdamW", "SGD momentum"]
    assert all(float(row.split(" | ")[4].replace(",", "")) > 0 for row in rows)  # fused's microseconds
