"""Mistakes answered before torch, Lightning or torchvision is imported (docs/measured.md, "Time to
a bad input's error"): those the composition catches (a key that is not there, an unknown choice, a
malformed override) and the values that the early checks refuse (trainer/configuration/early_checks.py:
the top-level keys, run, target, the optimizer's own keys, compile, regularization). The early
checks are the run's own functions: for a mistake in those keys they say what the run's validation
says."""

import subprocess
import sys

import pytest

from tests.helpers import REPO
from trainer.configuration.early_checks import check_before_imports
from trainer.configuration.spec import validate
from trainer.infra.errors import UserError
from trainer.testing import compose_recipe

# The entry point run as a person runs it, then the heavy libraries it had imported by its exit.
PROBE = """
import sys
sys.argv = ["train.py", *sys.argv[1:]]
try:
    from trainer.cli import main
    main()
except SystemExit as ex:
    code = ex.code
heavy = sorted(name for name in ("torch", "lightning", "torchvision") if name in sys.modules)
print("exit", code, "heavy", ",".join(heavy) or "none", file=sys.stderr)
"""

EARLY_VALUES = [
    ("optimizer.lr=-1", "error: optimizer.lr: -1 must be > 0"),
    ("optimizer.lr_scaling=cube", "error: optimizer.lr_scaling: 'cube' is not one of"),
    ("seed=-3", "error: seed: -3 must be >= 0"),
    ("objective=foo", "error: objective: 'foo' is not a metric name"),
    ("target.metric=val/acc", "error: target.value: missing"),
    ("compile.mode=fast", "error: compile.mode: 'fast' is not one of"),
    ("regularization.label_smoothing=1.5", "error: regularization.label_smoothing: 1.5 must be < 1"),
]


@pytest.mark.parametrize("override, says", [
    ("optimizer.lrr=1", "error: optimizer.lrr: not in the composed config"),
    ("model=nonexistent", "error: model: unknown choice 'nonexistent'"),
    ("optimizer.lr=[1", "error: optimizer.lr=[1"),
    *EARLY_VALUES,
])
def test_the_mistake_is_one_line_before_torch_is_imported_and_leaves_no_folder(tmp_path, override, says):
    proc = subprocess.run([sys.executable, "-c", PROBE, override, f"hydra.run.dir={tmp_path / 'runs' / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "exit 2 heavy none", proc.stderr
    assert len(lines) == 2 and lines[0].startswith(says), proc.stderr
    assert not (tmp_path / "runs" / "run").exists()


@pytest.mark.parametrize("override, says", EARLY_VALUES)
def test_the_early_checks_say_what_the_runs_validation_says(override, says):
    cfg = compose_recipe(None, [override])
    with pytest.raises(UserError) as early:
        check_before_imports(cfg)
    with pytest.raises(UserError) as full:
        validate(cfg)
    assert early.value.line() == full.value.line()
    assert f"error: {early.value.line()}".startswith(says)


def test_a_valid_config_passes_the_early_checks():
    check_before_imports(compose_recipe("digits_quickstart"))
