"""A language-model run survives a kill at any moment, and trains on two processes.

Killed with SIGKILL as a drawn training step ends (inside an epoch, between checkpoints), halfway
through a drawn checkpoint file, as a test batch ends and halfway through its completed summary, a
small GPT run on a folder of text carries on with ``resume=if_any`` and completes with the
uninterrupted run's final weights (tensor for tensor) and metrics (every value equal). Started on two
CPU processes by Lightning, the same run trains into one folder with the global batch in tokens
doubled and the lr scaled by it. The draws are seeded and printed (``KILL_SEED=N`` repeats one).
"""

from __future__ import annotations

import json
import math
import os
import random
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.helpers import ddp_forked, kill_during_save, train_forked

pytestmark = [pytest.mark.run, pytest.mark.slow]

SEED = int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(10**6))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A person's folder of text: two standard-library packages (about 400 KB)."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email"):
        for number, source in enumerate(sorted((stdlib / package).rglob("*.py"))):
            (root / f"{package}_{number}.py").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    return root


def tiny_lm(corpus: Path, cache: Path) -> list[str]:
    """A 2-block GPT on bytes (no tokenizer to train), 36 steps of 8 x 32 tokens in 3 epochs' worth of
    validation every 12 steps, checkpoints every 4 steps inside epochs, deterministic on the CPU."""
    return ["task=language_model", "data=text", f"data.root={corpus}", f"data.cache_dir={cache}", "data.tokenizer=byte",
            "data.sequence_length=32", "data.batch_size=8", "data.num_workers=0", "model=gpt", "model.layers=2",
            "model.width=32", "model.heads=2", "optimizer.ref_batch_size=256", "trainer.max_steps=36",
            "+trainer.val_check_interval=12", "trainer.limit_val_batches=4", "trainer.limit_test_batches=3",
            "trainer.deterministic=true", "checkpointing.every_n_steps=4", "progress=off", "logger=csv", "seed=5"]


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def results(summary: dict) -> dict:
    return {split: values for split, values in summary["metrics"].items() if split != "perf"}


def test_a_language_model_killed_at_any_moment_resumes_to_the_uninterrupted_result(tmp_path, corpus):
    args = tiny_lm(corpus, tmp_path / "cache")
    reference = train_forked([*args, f"run.root={tmp_path / 'reference'}"], tmp_path / "reference" / "run")
    assert reference.returncode == 0, reference
    expected, expected_weights = reference.summary, weights(reference.summary["final_checkpoint"])
    assert expected["steps"] == 36 and expected["task"]["unit"] == "tokens"
    draw = random.Random(SEED)
    step, save, batch = draw.randint(1, 35), draw.randint(1, 9), draw.randint(1, 3)
    print(f"\nlanguage-model kill draw: KILL_SEED={SEED}: step {step}, checkpoint file {save}, test batch {batch}")
    kill = "+callbacks.kill._target_=tests.helpers.KillJobAt"
    moments = [(f"step {step}", [kill, "+callbacks.kill.moment=step", f"+callbacks.kill.number={step}"], None),
               (f"checkpoint file {save}", [], kill_during_save(save)),
               (f"test batch {batch}", [kill, "+callbacks.kill.moment=test_batch", f"+callbacks.kill.number={batch}"],
                None),
               ("the completed summary", [kill, "+callbacks.kill.moment=summary"], None)]
    for number, (label, faults, setup) in enumerate(moments):
        root = tmp_path / f"moment{number}"
        run = [*args, f"run.root={root}", "run.name=killed"]
        killed = train_forked([*run, *faults], root / "first", setup=setup)
        assert killed.returncode == -9, (label, killed)
        resumed = train_forked([*run, "resume=if_any"], root / "second")
        assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, (label, resumed)
        written = [p for p in (root / "first" / "summary.json", root / "second" / "summary.json") if p.is_file()]
        summary = json.loads(max(written, key=lambda p: p.stat().st_mtime_ns).read_text())
        assert summary["status"] == "completed" and summary["steps"] == 36, label
        assert results(summary) == results(expected), label
        got = weights(summary["final_checkpoint"])
        assert all(torch.equal(expected_weights[k], got[k]) for k in expected_weights), label


def test_a_language_model_trains_on_two_processes_into_one_folder(tmp_path, corpus):
    # Rank 0 forked from this process, rank 1 started by Lightning's launcher and forked from this process
    # through a stand-in interpreter (tests.helpers.ddp_forked).
    result = ddp_forked([*tiny_lm(corpus, tmp_path / "cache"), "trainer=ddp", "trainer.devices=2",
                         "trainer.accelerator=cpu", "progress=plain"], tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done: ") + result.stderr.count("done: ") == 1  # rank 0 alone reports
    [folder] = [p for p in (tmp_path / "runs").glob("*/*") if p.is_dir()]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["processes"]["count"] == 2
    # 8 sequences of 32 tokens a process, 2 processes: the lr rule scales by 512 tokens
    assert summary["hyperparameters"]["global_batch_tokens"] == 512
    assert math.isclose(summary["hyperparameters"]["lr"], 0.004 * math.sqrt(512 / 256), rel_tol=1e-9)
    assert summary["throughput"]["processes"] == 2 and summary["throughput"]["tokens_per_s"] > 0
    assert summary["metrics"]["val"]["perplexity"] < 257  # below a uniform guess over the bytes
