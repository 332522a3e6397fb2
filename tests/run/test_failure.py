"""A crash mid-run keeps what was saved and records what happened: a crash (exit 1) leaves a
loadable last.ckpt of the epoch before and a summary.json with status failed; an injected CUDA
out-of-memory error ends in one line naming the batch size and the switches that need less
memory, with last.ckpt intact, also where data.batch_size=auto chose the batch."""

import pytest
import torch

from tests.helpers import train_forked

pytestmark = pytest.mark.run


def test_crash_after_the_first_epoch_keeps_its_checkpoint_and_writes_a_failed_summary(tmp_path):
    # 19 steps per epoch: call 25 is inside epoch 2, after epoch 1's checkpoint was written.
    result = train_forked(["model=custom", "model._target_=tests.helpers.ExplodingMLP", "+model.fail_at=25",
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


def test_out_of_memory_is_one_line_naming_the_batch_size_and_earlier_checkpoints_stay(tmp_path, capsys):
    import json

    from tests.helpers import run_in_process

    # 19 steps per epoch: call 25 is inside epoch 2, after epoch 1's checkpoint was written.
    with pytest.raises(SystemExit) as stopped:
        run_in_process(["model=custom", "model._target_=tests.helpers.MemoryHungryMLP", "+model.fail_at=25",
                        "trainer.max_epochs=3", "trainer.num_sanity_val_steps=0", "progress=off"], tmp_path)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.batch_size: out of device memory at batch size 64")
    assert "data.batch_size=32 with trainer.accumulate_grad_batches=2" in err[0]
    assert "the last checkpoint is intact" in err[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "OutOfMemoryError" in summary["error"]
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 19


#: Past the forward calls of the finder's memory measurement (an out-of-memory there is the finder's
#: own case); the finder takes the whole training split as the batch here, so an epoch is one step.
FAIL_AT_UNDER_AUTO = 6


def test_out_of_memory_under_batch_size_auto_names_the_batch_the_finder_chose(tmp_path, capsys):
    """With data.batch_size=auto the config holds "auto", not a number: the line names the batch the
    finder chose and halves that (the failure handler once did int("auto") and ended in a traceback)."""
    import json

    from tests.helpers import run_in_process

    with pytest.raises(SystemExit) as stopped:
        run_in_process(["model=custom", "model._target_=tests.helpers.MemoryHungryMLP",
                        f"+model.fail_at={FAIL_AT_UNDER_AUTO}", "data.batch_size=auto", "data.memory_budget_gb=0.02",
                        "trainer.accelerator=cpu", "trainer.max_epochs=8", "trainer.num_sanity_val_steps=0",
                        "progress=off"], tmp_path)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    batch = json.loads((tmp_path / "batch_size_auto.json").read_text())["batch_size"]
    assert len(err) == 1, err
    assert err[0].startswith(f"error: data.batch_size: out of device memory at batch size {batch} "
                             "(what data.batch_size=auto found)"), err[0]
    assert f"data.batch_size={batch // 2} with trainer.accumulate_grad_batches=2" in err[0]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
