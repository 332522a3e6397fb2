"""An encoder fine-tuned on labelled text, end to end on the CPU: the tiny recipe on the built-in
labelled set (Python standard-library snippets labelled by package, 8 classes), the same recipe on
a user's folder of class folders, and fine-tuning from a saved Hugging Face folder against random
initialisation on that folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import train_forked
from tests.shared_runs import encoder_recipe_run
from trainer.data.labelled_corpus import builtin_samples
from trainer.deploy.export import load_network

pytestmark = [pytest.mark.run, pytest.mark.slow]

#: The tiny recipe's floor: it measured val/acc 0.84-0.85 after its 5 epochs (docs/measured.md).
STATED_VAL_ACC = 0.75
#: Classes and samples of the user's folder: four packages of the built-in set, 40 snippets each.
FOLDER_CLASSES = ("asyncio", "email", "logging", "unittest")
FOLDER_PER_CLASS = 40


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """The whole recipe, as a person runs it (`python train.py +recipe=encoder_tiny_text`, forked):
    the session's one such run (tests/shared_runs.py), which test_serve_text.py serves a copy of."""
    return encoder_recipe_run(tmp_path_factory)


def test_the_tiny_recipe_learns_far_above_the_majority_class(recipe_run):
    summary = recipe_run.summary
    metrics, baseline = summary["metrics"], summary["data"]["baselines"]["val/acc"]
    assert summary["status"] == "completed" and summary["epochs"] == 5
    assert metrics["val"]["acc"] >= STATED_VAL_ACC and metrics["test"]["acc"] >= STATED_VAL_ACC - 0.05, metrics
    assert baseline < 0.2 and metrics["val"]["acc"] > 4 * baseline
    assert metrics["val"]["f1"] >= STATED_VAL_ACC - 0.05  # macro-F1: every class learned, not a few
    throughput = summary["throughput"]
    assert throughput["unit"] == "tokens" and throughput["tokens_per_s"] > throughput["samples_per_s"] > 0
    assert summary["task"]["unit"] == "samples" and summary["derived"]["model.flops_per_token"]["value"]
    assert "against the baseline" in recipe_run.stdout + recipe_run.stderr


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """Class folders of .txt files, as a team would lay them out."""
    root = tmp_path_factory.mktemp("labelled_folder")
    counts = dict.fromkeys(FOLDER_CLASSES, 0)
    for sample in builtin_samples():
        label = sample.labels[0]
        if label in counts and counts[label] < FOLDER_PER_CLASS:
            (root / label).mkdir(exist_ok=True)
            (root / label / f"{counts[label]:03d}.txt").write_text(sample.text)
            counts[label] += 1
    return root


def test_a_saved_encoder_fine_tunes_on_a_users_folder_far_better_than_random_init(recipe_run, user_folder, tmp_path):
    """The recipe's network, saved as a Hugging Face folder with its tokenizer, is loaded by
    model.pretrained; two epochs on 160 texts then beat the same two epochs from random init by a
    wide margin (a load that silently kept the random weights would not)."""
    run_dir = recipe_run.run_dir
    net, *_ = load_network(run_dir, Path(recipe_run.summary["best_checkpoint"]), tmp_path / "scratch")
    pretrained = net.save_pretrained(tmp_path / "pretrained")
    shutil.copyfile(run_dir / "tokenizer.json", pretrained / "tokenizer.json")
    common = ["+recipe=encoder_tiny_text", f"data.source={user_folder}", f"data.tokenizer={pretrained}/tokenizer.json",
              "trainer.max_epochs=2", "data.batch_size=16", f"data.cache_dir={tmp_path / 'cache'}", "progress=plain"]
    tuned = train_forked([*common, f"model.pretrained={pretrained}"], tmp_path / "tuned", timeout=300)
    fresh = train_forked(common, tmp_path / "fresh", timeout=300)
    assert tuned.returncode == 0 and fresh.returncode == 0, (tuned, fresh)
    tuned_acc, fresh_acc = (run.summary["metrics"]["val"]["acc"] for run in (tuned, fresh))
    assert tuned_acc >= 0.8 and tuned_acc >= fresh_acc + 0.2, (tuned_acc, fresh_acc)
    assert tuned.summary["data"]["num_classes"] == fresh.summary["data"]["num_classes"] == len(FOLDER_CLASSES)
