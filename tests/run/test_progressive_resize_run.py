"""`data.progressive_resize=true` in real runs on an image folder of JPEG digits.

The sizes the steps saw per epoch are the plan's schedule (16, 16, 24, 32 px over 4 epochs),
evaluation runs at the final size, the throughput meter reports each size, and the run still
learns. With torch.compile and channels_last the same run trains through every size change: each
training size compiles its own graph (on torch 2.14 automatic dynamic shapes do not merge them:
TORCH_LOGS=recompiles shows a size mismatch at 24 and again at 32), evaluation its own, and the
recompile limit the plan raises (trainer/groups/compile.py) covers them all.
"""

from __future__ import annotations

import pytest

from tests.helpers import ON_CPU, train_forked, write_digit_pngs

pytestmark = pytest.mark.run

RESIZED = ["data=imagefolder", "data.image_size=32", "data.train_crop_scale=[0.85,1.0]", "data.hflip=false",
           "data.eval_crop_fraction=1.0", "data.batch_size=32", "data.num_workers=1", "model=small_cnn",
           "data.progressive_resize=true", "data.resize_start=0.5", "data.resize_ramp=[0.25,0.75]",
           "trainer.max_epochs=4", "progress=plain", "checkpointing=off"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("digits_jpeg")
    write_digit_pngs(root, {"train": 40, "val": 10}, size=32, suffix=".jpg")
    return root


def test_the_steps_of_each_epoch_see_the_schedules_size_and_evaluation_the_final_one(digits, tmp_path):
    # On the CPU: the accuracy band was measured there.
    result = train_forked([*ON_CPU, *RESIZED, f"data.root={digits}"], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    schedule = summary["derived"]["data.progressive_resize"]
    assert schedule["value"] == [16, 16, 24, 32] and "evaluation at 32 px" in schedule["how"]
    throughput = summary["throughput"]
    assert throughput["side_by_epoch"] == [16, 16, 24, 32]
    # 12 steps an epoch: windows of 10 after each size's 5 warm-up steps fill only now and then
    assert set(throughput.get("samples_per_s_by_side", {})) <= {"16", "24", "32"}
    assert summary["data"]["image_size"] == [32, 32]  # what evaluation and export see
    assert summary["metrics"]["test"]["acc"] >= 0.5  # ten classes: chance is 0.1


@pytest.mark.slow
def test_compiled_channels_last_training_goes_through_every_size(digits, tmp_path):
    result = train_forked([*ON_CPU, *RESIZED, f"data.root={digits}", "compile=default",
                           "precision.channels_last=true", "trainer.max_epochs=4"], tmp_path / "run", timeout=600)
    assert result.returncode == 0, result
    summary = result.summary
    assert summary["throughput"]["side_by_epoch"] == [16, 16, 24, 32]
    assert summary["derived"]["compile"]["value"] == "default"
    assert summary["metrics"]["test"]["acc"] >= 0.5
