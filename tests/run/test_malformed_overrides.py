"""Property: any override a person could type either runs or ends with exit code 2 and one line
naming the key, never a traceback (hypothesis generates 20 of them; the examples are derandomized
so CI sees the same ones every time)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import train_forked

pytestmark = pytest.mark.run

# Real keys of every group (run length keys left out: a valid example must stay a two-step run).
KEYS = ["optimizer.lr", "optimizer.weight_decay", "optimizer.betas", "optimizer.lr_scaling", "optimizer.implementation",
        "data.batch_size", "data.num_workers", "data.val_fraction", "data.translate", "data.prefetch_factor",
        "model.width", "model.activation_checkpointing", "precision.name", "precision.channels_last",
        "scheduler.warmup", "scheduler.min_lr_ratio", "clipping.percentile", "clipping.calibration_steps",
        "nonfinite.max_consecutive", "checkpointing.monitor", "trainer.accumulate_grad_batches",
        "trainer.log_every_n_steps", "seed", "progress", "optimizer", "data", "model", "precision", "scheduler",
        "clipping", "logger.csv", "trainer.deterministic"]
SMALL = ["trainer.max_steps=2", "trainer.max_epochs=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
         "trainer.num_sanity_val_steps=0", "checkpointing=off", "progress=off"]

names = st.from_regex(r"[a-z_]{1,10}(\.[a-z_]{1,10}){0,2}", fullmatch=True)
scalars = st.one_of(
    st.integers(-10**6, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).replace("inf", "inf")),
    st.sampled_from(["true", "false", "null", "auto", "[]", "{}", "''", "[0.1", "1e-3", "-0", "abc", "a b", "${x}",
                     "${oc.env:NOPE}", "???", "[1,2,3]", "{a: 1}", "resnet9000", "sgd", "fp32"]),
    st.text(alphabet=st.characters(codec="ascii", exclude_categories=["Cc"]), max_size=8),
)
overrides = st.tuples(st.sampled_from(["", "+", "++", "~"]), st.one_of(st.sampled_from(KEYS), names), scalars).map(
    lambda t: f"{t[0]}{t[1]}" if t[0] == "~" and t[2] == "" else f"{t[0]}{t[1]}={t[2]}")


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(override=overrides)
def test_a_malformed_override_runs_or_ends_in_one_line_naming_the_key(override, tmp_path_factory):
    result = train_forked([*SMALL, override], tmp_path_factory.mktemp("run"), timeout=180)
    assert "Traceback" not in result.stderr + result.stdout, (override, result)
    if result.returncode == 0:
        return
    assert result.returncode == 2, (override, result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (override, result)
    key = override.lstrip("+~").split("=", 1)[0]
    assert key.split(".")[0] in lines[0] or key in lines[0], (override, lines[0])
