"""A crash mid-run keeps what was saved and records what happened."""

import pytest
import torch

from tests.helpers import train

pytestmark = pytest.mark.run


def test_crash_after_the_first_epoch_keeps_its_checkpoint_and_writes_a_failed_summary(tmp_path):
    # 19 steps per epoch: call 25 is inside epoch 2, after epoch 1's checkpoint was written.
    result = train(["model=custom", "model._target_=tests.helpers.ExplodingMLP", "+model.fail_at=25",
                    "trainer.max_epochs=3", "progress=plain"], tmp_path / "run")
    assert result.returncode == 1, result  # a bug, not a user mistake: Hydra's traceback, exit 1
    assert "simulated crash" in result.stderr
    summary = result.summary
    assert summary["status"] == "failed"
    assert "simulated crash" in summary["error"]
    assert summary["steps"] == 19 + 5
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 19 and checkpoint["epoch"] == 0
    assert "net.net.1.weight" in checkpoint["state_dict"]
