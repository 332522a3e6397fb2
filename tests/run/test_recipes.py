"""Every recipe in recipes/ trains two steps on tiny data (a glob, so a new recipe is
covered); a ladder stage records exactly the keys it changes from its parent, also for a team's
recipe folder on the search path; the baseline differs from the optimized recipe by the practices
switched off; a ResNet-50 recipe without data.root and a ladder outside a multirun are one line
each; the first losses of digits_quickstart match the stored golden values."""

from __future__ import annotations

import email
import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers import ON_CPU, RECIPES, TINY, run_in_process
from trainer.infra.command import invoked_as

pytestmark = pytest.mark.run

RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml"))
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "digits_quickstart_first_losses.json"


def test_the_shipped_recipes_are_there():
    assert {"digits_quickstart", "cifar10_resnet18", "resnet50_baseline", "resnet50_optimized"} <= set(RECIPE_NAMES)


def tiny_data_for(name: str, tmp_path: Path) -> list[str]:
    """TINY, or the same two steps on data the recipe's own data keys apply to: a tiny folder of
    real photos for an image-folder recipe (crops, flips, augmentation), the bundled digits for a
    digits recipe (its translation)."""
    from tests.helpers import compose, write_photo_jpegs

    target = str(compose([f"+recipe={name}", *ON_CPU])["data"]["_target_"])
    without_data = [o for o in TINY if not o.startswith("data")]
    if target.endswith("DigitsDataModule"):
        return [*without_data, "data.batch_size=4"]
    if target.endswith("LabelledTextData"):  # an encoder's recipe: a small JSONL of two labels
        import json

        source = tmp_path / "labelled.jsonl"
        lines = [{"text": f"{word} " * (3 + number % 7) + f"sample {number}", "label": word}
                 for number in range(40) for word in ("alpha", "omega")]
        source.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return [*without_data, f"data.source={source}", "data.max_length=32", "data.batch_size=4",
                f"data.cache_dir={tmp_path / 'cache'}"]
    if target.endswith("TextData"):  # a language model's recipe: a small folder of text, bytes as tokens
        corpus = tmp_path / "text"
        corpus.mkdir()
        for number, source in enumerate(sorted(Path(email.__file__).parent.glob("*.py"))):
            (corpus / f"{number}.py").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
        return [*without_data, f"data.root={corpus}", "data.tokenizer=byte", "data.sequence_length=32",
                "data.batch_size=4", "data.num_workers=0", f"data.cache_dir={tmp_path / 'cache'}",
                "data.val_fraction=0.2", "data.test_fraction=0.2"]
    if not target.endswith("ImageFolderDataModule"):
        return TINY
    root = tmp_path / "photos"
    write_photo_jpegs(root, {"train": 4, "val": 2}, size=(64, 48))
    # The lr range test's answer on four random photos is noise: with one compute thread its loss
    # diverged before any descent, with two it found one. Its recipe runs its two steps at a given lr
    # here; the range test is tested on the digits (tests/run/test_lr_schedule.py).
    given_lr = ["optimizer.lr=0.1"] if name == "small_images_lr_find" else []
    return [*without_data, f"data.root={root}", "data.image_size=32",
            "data.batch_size=4", "data.num_workers=0", "data.persistent_workers=false", *given_lr]


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_every_recipe_runs_two_steps_on_tiny_data(name, tmp_path):
    summary = run_in_process([f"+recipe={name}", *tiny_data_for(name, tmp_path)], tmp_path / "run")
    assert summary["status"] == "completed"
    assert summary["steps"] == 2
    assert summary["recipe"]["name"] == name
    assert summary["choices"]["recipe"] == name
    assert len(summary["loss"]["first"]) == 2 and all(math.isfinite(v) for v in summary["loss"]["first"])


def test_a_stage_records_exactly_the_keys_it_changes_from_its_parent(tmp_path):
    summary = run_in_process(["+recipe=resnet50_channels_last", *TINY], tmp_path)
    assert summary["recipe"]["parent"] == "resnet50_amp"
    assert summary["recipe"]["differs_from_parent"] == {"precision.channels_last": [False, True]}


def test_the_baseline_differs_from_optimized_by_the_practices_switched_off():
    from tests.helpers import compose
    from trainer.configuration.recipes import differences, with_recipe
    from trainer.configuration.spec import to_plain

    base = to_plain(compose(with_recipe(TINY, "resnet50_baseline")))
    optimized = to_plain(compose(with_recipe(TINY, "resnet50_optimized")))
    changed = differences(optimized, base)
    assert changed["precision.name"] == ["auto", "fp32"]
    assert changed["precision.channels_last"] == ["auto", False]
    assert changed["precision.tf32"] == ["auto", False]
    assert changed["compile.mode"] == ["auto", "off"]
    assert changed["clipping._target_"] == ["trainer.groups.clipping.Percentile", "trainer.groups.clipping.Off"]
    assert changed["optimizer.lr_scaling"] == ["linear", "none"]
    assert changed["optimizer.implementation"] == ["auto", "for_loop"]
    assert changed["optimizer.decay_norm_and_bias"] == [False, True]
    assert changed["data.num_workers"] == ["auto", 0] and changed["data.device_normalize"] == [True, False]
    assert changed["data.decode"] == ["auto", "pil"]
    # Keys that only the percentile clipping choice has appear as removed; nothing else changes.
    assert set(changed) - {k for k in changed if k.startswith("clipping.")} == {
        "precision.name", "precision.channels_last", "precision.tf32", "compile.mode", "optimizer.lr_scaling",
        "optimizer.implementation", "optimizer.decay_norm_and_bias", "data.num_workers", "data.pin_memory",
        "data.persistent_workers", "data.device_normalize", "data.decode"}


def test_a_resnet50_recipe_without_a_data_folder_says_how_to_set_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        run_in_process(["+recipe=resnet50_optimized", "trainer.max_steps=1"], tmp_path)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.root: not set")
    assert "data=synthetic" in err[0]


def test_a_ladder_outside_a_multirun_is_refused_with_the_command_to_use(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        run_in_process(["+ladder=resnet18_cpu", *TINY], tmp_path)
    assert stopped.value.code == 2
    assert f"{invoked_as()} -m +ladder=resnet18_cpu" in capsys.readouterr().err  # the command as it was typed


def test_digits_quickstart_first_losses_match_the_stored_values(tmp_path):
    """Deterministic CPU settings: the first losses are a fingerprint of the whole training path
    (data split and order, initialization, loss, optimizer, lr schedule). Regenerate after an
    intended change with UPDATE_GOLDEN=1. Pinned to the CPU: the stored values are fp32 CPU
    arithmetic (on a GPU, auto would train in bf16 with other kernels)."""
    summary = run_in_process(["+recipe=digits_quickstart", *ON_CPU, "trainer.deterministic=true", "trainer.max_steps=8",
                              "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=1",
                              "trainer.limit_test_batches=1", "checkpointing=off", "progress=off"], tmp_path)
    losses = summary["loss"]["first"][:8]
    assert len(losses) == 8
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"recipe": "digits_quickstart", "losses": losses}, indent=2) + "\n")
    stored = json.loads(GOLDEN.read_text())["losses"]
    assert losses == pytest.approx(stored, rel=1e-4, abs=1e-5)


def test_a_team_recipe_folder_on_the_search_path_records_its_own_parent(tmp_path):
    from tests.helpers import train_forked

    team = tmp_path / "team_recipes"
    team.mkdir()
    (team / "team_base.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: resnet18\n"
                                         "  - _self_\noptimizer:\n  lr: 0.01\n")
    (team / "team_fast.yaml").write_text("# @package _global_\ndefaults:\n  - team_base\n  - _self_\n"
                                         "optimizer:\n  lr: 0.02\n")
    result = train_forked(["+recipe=team_fast", f"hydra.searchpath=[recipes://{team}]", *TINY], tmp_path / "run")
    assert result.returncode == 0, result
    recipe = result.summary["recipe"]
    assert recipe["parent"] == "team_base" and recipe["file"] == str(team / "team_fast.yaml")
    assert recipe["differs_from_parent"] == {"optimizer.lr": [0.01, 0.02]}
