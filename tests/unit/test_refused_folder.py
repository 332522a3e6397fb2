"""A run refused before it trains removes the folder Hydra made for it, and only that: the rule that a
folder is this job's own (trainer/phases/compose.py) and what may be removed (trainer/phases/failures.py)."""

from pathlib import Path

from trainer.phases.compose import made_by_this_job
from trainer.infra.atomic import remove_empty_folders
from trainer.phases.compose import remove_refused_folder


def hydra_start(folder: Path, log: str = "") -> Path:
    """What Hydra writes as a job starts: its record and the (empty) log file."""
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text("x: 1\n")
    (folder / "train.log").write_text(log)
    return folder


def test_a_folder_is_the_jobs_own_when_it_holds_only_what_hydra_just_wrote(tmp_path):
    assert made_by_this_job(tmp_path / "not-yet")
    assert made_by_this_job(hydra_start(tmp_path / "fresh"))
    # used before: a log with lines, a run's record, checkpoints, anything else
    assert not made_by_this_job(hydra_start(tmp_path / "logged", "[INFO] an earlier attempt\n"))
    for extra in ("run.json", "summary.json", "checkpoints"):
        folder = hydra_start(tmp_path / extra.replace(".", "_"))
        (folder / extra).write_text("{}")
        assert not made_by_this_job(folder), extra
    odd = hydra_start(tmp_path / "odd")
    (odd / ".hydra" / "notes.txt").write_text("mine")
    assert not made_by_this_job(odd)


def test_only_what_the_start_wrote_is_removed(tmp_path):
    started = hydra_start(tmp_path / "started", "[INFO] the plan\n")
    for name in ("run.json", "env.json", "config_resolved.yaml"):
        (started / name).write_text("{}")
    assert remove_refused_folder(started) and not started.exists()
    for kept in ("summary.json", "bad_files.tsv", "wandb"):
        folder = hydra_start(tmp_path / kept.replace(".", "_"))
        (folder / kept).write_text("kept")
        assert not remove_refused_folder(folder) and (folder / kept).read_text() == "kept"


def test_the_emptied_folders_up_to_the_run_root_go_and_no_other(tmp_path):
    root = tmp_path / "outputs"
    day = root / "runs" / "2026-01-02"
    (day / "other-run").mkdir(parents=True)
    remove_empty_folders(day, below=root)
    assert (day / "other-run").is_dir()  # the day still holds a run: nothing goes
    (day / "other-run").rmdir()
    remove_empty_folders(day, below=root)
    assert root.is_dir() and list(root.iterdir()) == []  # runs/ and the day went, run.root stays
    outside = tmp_path / "elsewhere" / "day"
    outside.mkdir(parents=True)
    remove_empty_folders(outside, below=root)
    assert outside.is_dir()  # not below run.root: the person's folders
