"""A run killed with SIGKILL at any moment of its life, from start-up to the last byte of its summary,
carries on with ``resume=if_any`` and completes with the uninterrupted run's final weights (tensor
for tensor) and metrics (train, validation and test: every value equal).

The moments are a seeded draw, printed, and new at every run of the suite (``KILL_SEED=N`` repeats
one): one moment in each eighth of the uninterrupted run's wall time, so start-up, training, the
last validation, the test and the summary are all in reach; and three moments placed by events
that a clock would rarely hit: halfway through writing a checkpoint file (which one is drawn),
during a test batch (drawn), and halfway through writing the completed summary. The resume alternates
between the killed run's own folder (a requeued job) and a new one (the command run again). Where
the kill came after the run had completed, the resume says so in one line and exits 0.

A completed run asked to resume (auto or if_any) does not train again: one line, exit 0, its
summary untouched. A failure while the completed run is recorded is one line and a failed summary
that says so; the same command with resume=if_any then records the run with the same metrics. The deterministic CPU settings of tests/run/test_resume.py make the runs
comparable bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.helpers import (ON_CPU, ForkedRun, Result, kill_during_save, kill_writing_completed_summary,
                           train_forked, train_py_argv)

pytestmark = pytest.mark.run

# Digits, 6 batches an epoch, 3 epochs: last.ckpt every 2 steps inside epochs and at each epoch
# end (with the best by val/loss); 3 test batches.
RUN = [*ON_CPU, "trainer.max_epochs=3", "trainer.limit_train_batches=6", "trainer.limit_val_batches=2",
       "trainer.limit_test_batches=3", "trainer.num_sanity_val_steps=1", "trainer.deterministic=true",
       "checkpointing.every_n_steps=2", "progress=off", "logger=csv", "seed=3"]
FINAL_STEP = 18
TEST_BATCHES = 3
TIMED_MOMENTS = 8
SEED = int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(10**6))


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def compared(metrics: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """What a run reached; the throughput it logged (perf/) is a timing, not a result."""
    return {split: values for split, values in metrics.items() if split != "perf"}


def count_saves(counter: Path) -> Callable[[], None]:
    """Append a line to `counter` for every checkpoint file the run writes."""
    def setup() -> None:
        import trainer.infra.checkpoint_files

        real_save = torch.save

        def counting_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
            if isinstance(f, (str, Path)):
                with open(counter, "a") as out:
                    out.write(f"{f}\n")
            return real_save(obj, f, *args, **kwargs)

        trainer.infra.checkpoint_files.torch.save = counting_save  # type: ignore[attr-defined]
    return setup


class Reference:
    def __init__(self, result: Result, wall_s: float, saves: int, args: list[str]) -> None:
        assert result.run_dir is not None
        self.run_dir = result.run_dir
        self.args = args  # the command's overrides (its run.root and run.name among them)
        self.summary = result.summary
        self.weights = weights(result.run_dir / "checkpoints" / "last.ckpt")
        self.wall_s = wall_s
        self.saves = saves


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run, twice: the second is timed (the first pays this process's one-time
    costs, which no later run has) and must equal the first."""
    root = tmp_path_factory.mktemp("reference")
    runs = []
    for number in range(2):
        counter = root / f"saves{number}.txt"
        started = time.monotonic()
        args = [*RUN, f"run.root={root}", f"run.name=reference{number}"]
        result = train_forked(args, root / f"run{number}", setup=count_saves(counter))
        wall = time.monotonic() - started
        assert result.returncode == 0, result
        assert result.summary["steps"] == FINAL_STEP and result.summary["phase"] == "completed"
        runs.append(Reference(result, wall, len(counter.read_text().splitlines()), args))
    first, second = runs
    assert compared(first.summary["metrics"]) == compared(second.summary["metrics"])
    assert all(torch.equal(first.weights[k], second.weights[k]) for k in first.weights)
    return second


def moments(reference: Reference) -> list[tuple[str, float | None, Callable[[], None] | None, list[str]]]:
    """(label, seconds after the start to kill at or None, fault injected in the child or None,
    overrides that add a fault)."""
    draw = random.Random(SEED)
    timed = [(i + draw.random()) * reference.wall_s / TIMED_MOMENTS for i in range(TIMED_MOMENTS)]
    save = draw.randint(1, reference.saves)
    batch = draw.randint(1, TEST_BATCHES)
    kill_in_test = ["+callbacks.kill._target_=tests.helpers.KillJobAt", "+callbacks.kill.moment=test_batch",
                    f"+callbacks.kill.number={batch}"]
    return [*((f"at {t:.2f} s of {reference.wall_s:.2f} s", t, None, []) for t in timed),
            (f"halfway through checkpoint file {save} of {reference.saves}", None, kill_during_save(save), []),
            (f"as test batch {batch} of {TEST_BATCHES} ends", None, None, kill_in_test),
            ("halfway through writing the completed summary", None, kill_writing_completed_summary, [])]


def completed_summary(*folders: Path) -> dict[str, Any]:
    """The newest summary.json among `folders` (the resumed run's, or the killed run's where the
    kill came after it had completed), which must say completed."""
    written = [f / "summary.json" for f in folders if (f / "summary.json").is_file()]
    newest = max(written, key=lambda p: p.stat().st_mtime_ns)
    summary = json.loads(newest.read_text())
    assert summary["status"] == "completed" and summary["phase"] == "completed", (newest, summary.get("phase"))
    return summary


def test_killed_at_any_moment_resumes_to_the_uninterrupted_result(tmp_path, reference):
    print(f"\nkill-anywhere draw: KILL_SEED={SEED}; the uninterrupted run took {reference.wall_s:.2f} s, "
          f"wrote {reference.saves} checkpoint files")
    failures = []
    for number, (label, at, fault, faulty) in enumerate(moments(reference)):
        root = tmp_path / f"moment{number}"
        args = [*RUN, f"run.root={root}", "run.name=killed"]
        first = root / "first"
        with ForkedRun(train_py_argv([*args, *faulty], first), first, setup=fault) as child:
            if at is not None:
                deadline = time.monotonic() + at
                while time.monotonic() < deadline and not child.done():
                    time.sleep(0.005)
                child.kill()
            killed = child.wait(timeout=120)
        phase = json.loads((first / "summary.json").read_text()).get("phase") if (first / "summary.json").is_file() \
            else "before its summary"
        # Even moments resume in the killed run's folder (a requeued job), odd ones in a new one.
        second = first if number % 2 == 0 else root / "second"
        resumed = train_forked([*args, "resume=if_any"], second)
        where = f"moment {number} ({label}; exit {killed.returncode}, summary then: {phase})"
        print(f"  {where}: resumed with exit {resumed.returncode}")
        if resumed.returncode != 0:
            failures.append(f"{where}: resume failed: {resumed!r}")
            continue
        assert "Traceback" not in resumed.stderr, resumed
        summary = completed_summary(first, second)
        if killed.returncode == 0:  # the run had completed before the kill came
            assert "already completed" in resumed.stdout + resumed.stderr, resumed
        assert summary["steps"] == FINAL_STEP, where
        if phase == "testing":  # killed after its training: the attempt says so, and lost no step
            assert summary["attempts"][0]["stopped_in"] == "testing" and summary["steps_lost"] == 0, where
        if compared(summary["metrics"]) != compared(reference.summary["metrics"]):
            failures.append(f"{where}: metrics {summary['metrics']} != {reference.summary['metrics']}")
        final = weights(summary["final_checkpoint"])
        different = [k for k in reference.weights if not torch.equal(final[k], reference.weights[k])]
        if different or final.keys() != reference.weights.keys():
            failures.append(f"{where}: {len(different)} tensors differ, e.g. {different[:3]}")
    assert not failures, "\n".join(failures)


def test_a_completed_run_asked_to_resume_says_so_in_one_line_and_changes_nothing(tmp_path, reference):
    """The completed run is the module's uninterrupted one (the fixture has read its summary and
    weights already): the same command with resume=if_any, then with resume=auto, each in a folder of
    its own, finds it, says so in one line and changes nothing there, which is what is checked after
    each (so the second request meets a completed run as untouched as the first did)."""
    first = reference.run_dir
    before = (first / "summary.json").read_bytes()
    for request in ("if_any", "auto"):
        again = train_forked([*reference.args, f"resume={request}"], tmp_path / request)
        assert again.returncode == 0, again
        said = [line for line in (again.stdout + again.stderr).splitlines() if "already completed" in line]
        assert len(said) == 1 and f"in {first}" in said[0], again
        assert "Traceback" not in again.stderr and "Restoring states" not in again.stdout + again.stderr
        assert (first / "summary.json").read_bytes() == before
        assert not (tmp_path / request / "summary.json").exists()
        assert not (tmp_path / request / "checkpoints").exists()


def fail_finishing_the_loggers() -> None:
    """A logger that cannot finish its run (say, wandb without its service) as the run is recorded."""
    import trainer.phases.record

    def finish(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("the logger's service could not be reached")

    trainer.phases.record.finish_loggers = finish  # type: ignore[assignment]


def test_a_failure_while_recording_is_one_line_and_the_run_records_again(tmp_path, reference):
    args = [*RUN, f"run.root={tmp_path}", "run.name=unrecorded"]
    failed = train_forked(args, tmp_path / "first", setup=fail_finishing_the_loggers)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {tmp_path / 'first' / 'summary.json'}: recording the completed run failed "
                           "(RuntimeError: the logger's service could not be reached)"), last
    summary = failed.summary
    assert (summary["status"], summary["stopped_in"]) == ("failed", "recording")
    assert summary["attempts"][-1]["stopped_in"] == "recording"
    assert weights(tmp_path / "first" / "checkpoints" / "last.ckpt").keys() == reference.weights.keys()

    again = train_forked([*args, "resume=if_any"], tmp_path / "second")
    assert again.returncode == 0, again
    assert compared(again.summary["metrics"]) == compared(reference.summary["metrics"])
    assert again.summary["requeues"] == 1 and again.summary["attempts"][0]["status"] == "failed"
