"""Mistakes the composition catches (a key that is not there, an unknown choice, a malformed
override) are answered before torch or Lightning is imported: their one line comes in a fraction of
a second (docs/measured.md, "Time to a bad input's error"). A value's mistake is the groups' schemas'
and comes after those imports (the same page says why)."""

import subprocess
import sys

import pytest

from tests.helpers import REPO

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


@pytest.mark.parametrize("override, says", [
    ("optimizer.lrr=1", "error: optimizer.lrr: not in the composed config"),
    ("model=nonexistent", "error: model: unknown choice 'nonexistent'"),
    ("optimizer.lr=[1", "error: optimizer.lr=[1"),
])
def test_a_composition_mistake_is_one_line_before_torch_is_imported(tmp_path, override, says):
    proc = subprocess.run([sys.executable, "-c", PROBE, override, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "exit 2 heavy none", proc.stderr
    assert len(lines) == 2 and lines[0].startswith(says), proc.stderr
    assert not (tmp_path / "run").exists()
