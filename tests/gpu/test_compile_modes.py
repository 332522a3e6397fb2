"""torch.compile on CUDA in each mode of the compile group (default, reduce-overhead, max-autotune):
a tiny network trains a few steps; the run records the mode; the module was compiled in place and
every training forward ran the compiled graph (the eager-only probe in the forward saw none); the
losses are finite; the checkpoint's keys are exactly the eager network's, with no `_orig_mod.`.
Kept small (8- and 16-channel convolutions on 16x16 images, no validation or test pass, which would
compile an eval graph too): compiling is the slow part of tests/gpu/."""

from __future__ import annotations

import math

import pytest

from tests.gpu.common import GPU, PROBE_STATE_KEYS, ProbeNet, checkpoint, probe_run
from tests.helpers import run_in_process

pytestmark = [*GPU, pytest.mark.slow]

STEPS = 4


@pytest.mark.parametrize("choice, mode", [("default", "default"), ("reduce_overhead", "reduce-overhead"),
                                          ("max_autotune", "max-autotune")])
def test_a_compiled_run_trains_and_saves_plain_keys(tmp_path, choice, mode):
    summary = run_in_process([*probe_run(STEPS, batch=8, image=16, width=8, evaluate=False), f"compile={choice}"],
                             tmp_path)
    assert summary is not None and summary["status"] == "completed", summary
    assert summary["steps"] == STEPS
    assert summary["derived"]["compile"]["value"] == mode
    net = ProbeNet.last()
    assert net._compiled_call_impl is not None  # nn.Module.compile: in place, the module stays itself
    assert net.records == []
    losses = summary["loss"]["first"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), losses
    state = checkpoint(tmp_path / "checkpoints" / "last.ckpt")["state_dict"]
    assert not [k for k in state if "_orig_mod." in k]
    assert {k for k in state if k.startswith("net.")} == PROBE_STATE_KEYS
