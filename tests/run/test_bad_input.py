"""Each bad input ends with one line naming the key, exit code 2, no traceback, before training, and
leaves no run folder behind (a folder that held a run before the job is kept as it was).

The cases run `train.py` in a forked child (`train_forked`: same entry point and exit code, no new
import of torch); one case runs in a fresh interpreter, as a person would, to keep that path honest.
"""

import os

import pytest

from tests.helpers import train, train_forked, write_digit_pngs

pytestmark = pytest.mark.run

CASES = {
    "unknown key": (["optimizer.learning_rate=0.1"], "optimizer.learning_rate"),
    "unknown added key": (["+data.colour=red"], "data.colour"),
    "unknown top-level key": (["+epochs=3"], "epochs"),
    "wrong type": (["data.batch_size=big"], "data.batch_size"),
    "lr zero": (["optimizer.lr=0"], "optimizer.lr"),
    "lr negative": (["optimizer.lr=-0.1"], "optimizer.lr"),
    "batch size zero": (["data.batch_size=0"], "data.batch_size"),
    "unknown choice": (["model=resnet9000"], "model"),
    "bad override syntax": (["optimizer.lr=[0.1"], "optimizer.lr"),
    "lr neither a number nor find": (["optimizer.lr=fast"], "optimizer.lr: 'fast' is not a number > 0 or one of 'find'"),
    "lr range test range upside down": (["optimizer.lr=find", "optimizer.find_min_lr=1", "optimizer.find_max_lr=0.1"],
                                        "optimizer.find_max_lr"),
    # The range test runs (20 steps) and its loss diverges at once: no suggestion to train with.
    "lr range test without a suggestion": (["optimizer=sgd", "optimizer.lr=find", "optimizer.find_steps=20",
                                            "optimizer.find_min_lr=1e4", "optimizer.find_max_lr=1e6"],
                                           "optimizer.lr: find: the lr range test has no suggestion"),
    "imagefolder without root": (["data=imagefolder"], "data.root"),
    "imagefolder missing path": (["data=imagefolder", "data.root=/no/such/folder"], "data.root"),
    "cifar10 without root": (["data=cifar10"], "data.root"),
    "cifar10 missing path": (["data=cifar10", "data.root=/no/such/folder"], "data.root"),
    # Lightning refuses it while the Trainer is built (after the data and the plan).
    "trainer value Lightning refuses": (["trainer.max_epochs=-2"], "trainer.max_epochs"),
    "trainer value Lightning refuses unnamed": (["trainer.devices=junk"], "trainer.devices"),
    # Lightning accepts it when built and divides by it once fit starts: refused up front.
    "trainer value failing only at fit": (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches"),
    "nested trainer target": (["+trainer.strategy={_target_: no.such.Strategy}"], "trainer.strategy._target_"),
    "nested constructor refusal": (["+trainer.profiler={_target_: lightning.pytorch.profilers.PyTorchProfiler,"
                                    "sort_by_key: nonsense}"], "trainer.profiler"),
    "precision plugin": (["+trainer.plugins=[{_target_: lightning.pytorch.plugins.MixedPrecision,precision: 16-mixed,"
                          "device: cpu}]"], "trainer.plugins[0]._target_"),
    "callback the framework sets": (["+callbacks.best._target_=lightning.pytorch.callbacks.ModelCheckpoint"],
                                    "callbacks.best: ModelCheckpoint is set by the framework"),
    "callback key its constructor lacks": (["callbacks=early_stopping", "+callbacks.early_stopping.patiense=2"],
                                           "callbacks.early_stopping.patiense"),
}


@pytest.mark.parametrize("args, key", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_line(tmp_path, args, key):
    result = train_forked(args, tmp_path / "run")
    _assert_one_line_error(result, key)


def test_bad_input_is_one_line_in_a_fresh_interpreter(tmp_path):
    result = train(["optimizer.learning_rate=0.1"], tmp_path / "run")
    _assert_one_line_error(result, "optimizer.learning_rate")


def test_a_value_lightning_refuses_is_one_line_in_a_fresh_interpreter(tmp_path):
    result = train(["trainer.max_epochs=-2"], tmp_path / "run")
    _assert_one_line_error(result, "trainer.max_epochs")
    assert "non-negative integer or -1" in result.stderr


def test_folders_without_images(tmp_path):
    empty = tmp_path / "empty"
    (empty / "train" / "cat").mkdir(parents=True)
    (empty / "val" / "cat").mkdir(parents=True)
    (empty / "train" / "cat" / "notes.txt").write_text("not an image")
    result = train_forked(["data=imagefolder", f"data.root={empty}"], tmp_path / "run1")
    _assert_one_line_error(result, "data.root")
    assert "no images" in result.stderr
    result = train_forked(["data=cifar10", f"data.root={empty}"], tmp_path / "run2")
    _assert_one_line_error(result, "data.root")


def test_val_classes_must_exist_in_train(tmp_path):
    root = tmp_path / "pngs"
    write_digit_pngs(root, {"train": 2}, classes=[0, 1], size=8)
    write_digit_pngs(root, {"val": 2}, classes=[0, 2], size=8)
    result = train_forked(["data=imagefolder", f"data.root={root}", "data.image_size=8", "data.batch_size=2"],
                          tmp_path / "run")
    # The folder stays: it holds bad_files.tsv, the data set's record of what it refused.
    _assert_one_line_error(result, str(root / "val"), folder_gone=False)
    assert (result.run_dir / "bad_files.tsv").exists()
    assert "digit_2" in result.stderr


def test_full_error_shows_the_traceback(tmp_path):
    # Set in the child after train_forked has cleared it: Hydra reads it as the error is handled.
    result = train_forked(["optimizer.lr=0"], tmp_path / "run", setup=lambda: os.environ.update(HYDRA_FULL_ERROR="1"))
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "optimizer.lr" in result.stderr


def _assert_one_line_error(result, key, folder_gone=True):
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result
    assert lines[0].startswith(f"error: {key}"), result
    assert "Traceback" not in result.stderr + result.stdout
    assert not (result.run_dir / "checkpoints").exists()
    assert "epoch 1" not in result.stdout
    if folder_gone:
        assert not result.run_dir.exists(), sorted(p.name for p in result.run_dir.iterdir())


def test_a_refused_run_leaves_no_folder_under_the_run_root(tmp_path):
    # As Hydra lays out a single run: run.root/runs/DAY/TIME; the day's folder goes too once empty.
    root = tmp_path / "outputs"
    result = train_forked(["optimizer.lr=-1", f"run.root={root}"], root / "runs" / "2026-01-02" / "03-04-05")
    assert result.returncode == 2, result
    assert list(root.iterdir()) == []


def test_a_refused_run_into_a_folder_used_before_keeps_it_as_it_was(tmp_path):
    # A resume (or a re-run) into the folder of an earlier run, refused for a bad value: nothing of
    # the earlier run goes, only Hydra's own record of the job is rewritten.
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    kept = {"run.json": '{"name": "earlier"}', "train.log": "[INFO] the earlier run\n",
            "checkpoints/last.ckpt": "weights"}
    for name, text in kept.items():
        (folder / name).write_text(text)
    result = train_forked(["optimizer.lr=-1", "resume=auto"], folder)
    assert result.returncode == 2, result
    assert {name: (folder / name).read_text() for name in kept} == kept
    # even a folder holding only what a refused start writes, once its log has lines from before
    only_log = tmp_path / "only_log"
    only_log.mkdir()
    (only_log / "train.log").write_text("[INFO] an earlier attempt\n")
    assert train_forked(["optimizer.lr=-1"], only_log).returncode == 2
    assert (only_log / "train.log").read_text().startswith("[INFO] an earlier attempt")
