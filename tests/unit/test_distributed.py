"""Which process is rank 0 before any process group exists (rank and launcher read from
torchrun's, srun's and Lightning's variables), which launches are refused with one line, the
other ranks writing no Hydra copy and no log file, evaluation shares counting every sample
exactly once, two gloo processes clipping their gradient shards by the norm of the whole
gradient (slow), and Lightning's child processes taking rank 0's launch time."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from trainer.data.base import EvalShare
from trainer.infra.distributed import (LaunchRefused, check_launch, is_rank_zero, launched_by, process_rank,
                                       quiet_hydra_outputs)
from trainer.infra.errors import UserError

TORCHRUN_RANK1 = {"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
SRUN_TASK2 = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NAME": "train"}


@pytest.mark.parametrize("env, launcher, rank", [
    ({}, None, 0),
    (TORCHRUN_RANK1, "torchrun", 1),
    ({**TORCHRUN_RANK1, "RANK": "0", "LOCAL_RANK": "0"}, "torchrun", 0),
    (SRUN_TASK2, "slurm", 2),
    # An interactive allocation's shell is no task of a multi-task step (as Lightning decides).
    ({**SRUN_TASK2, "SLURM_JOB_NAME": "bash", "SLURM_PROCID": "0"}, None, 0),
    # Lightning's own launcher: its children get LOCAL_RANK; further nodes get NODE_RANK.
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, None, 1),
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, None, 1),
])
def test_the_launcher_and_rank_are_read_from_the_environment(env, launcher, rank):
    assert launched_by(env) == launcher
    assert process_rank(env) == rank
    assert is_rank_zero(env) == (rank == 0)


def test_launches_that_cannot_give_one_run_are_refused_with_one_line():
    check_launch(1, multirun=True, launcher_target="hydra._internal.core_plugins.basic_launcher.BasicLauncher",
                 env={})  # one process: any sweep is fine
    check_launch(2, multirun=False, launcher_target="", env={})  # Lightning starts the other
    with pytest.raises(LaunchRefused) as caught:
        check_launch(2, multirun=True, launcher_target="hydra._internal.core_plugins.basic_launcher.BasicLauncher",
                     env={})
    assert caught.value.line().startswith("trainer.devices: 2 processes per job inside a Hydra multirun")
    # Hydra's submitit SLURM launcher: each job is one SLURM task per device, started by srun.
    check_launch(4, multirun=True, env=SRUN_TASK2,
                 launcher_target="hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher")
    with pytest.raises(LaunchRefused):  # the local submitit launcher starts one task per job
        check_launch(2, multirun=True, env={},
                     launcher_target="hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher")
    with pytest.raises(UserError, match="torchrun started 2 processes but the config trains on 1"):
        check_launch(1, multirun=False, launcher_target="", env=TORCHRUN_RANK1)
    with pytest.raises(UserError, match="runs on CUDA GPUs only, and this run's accelerator is cpu"):
        check_launch(2, multirun=False, launcher_target="", strategy="fsdp", accelerator="cpu",
                     env={})


def test_other_ranks_write_no_hydra_copy_and_no_log_file():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.helpers import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    assert "file" in cfg.hydra.job_logging.handlers and cfg.hydra.output_subdir == ".hydra"
    OmegaConf.set_readonly(cfg.hydra, False)
    quiet_hydra_outputs(cfg)
    assert cfg.hydra.output_subdir is None
    assert "file" not in cfg.hydra.job_logging.handlers and "file" not in cfg.hydra.job_logging.root.handlers
    assert "console" in cfg.hydra.job_logging.root.handlers


def test_evaluation_shares_cover_every_sample_exactly_once():
    shares = [list(EvalShare(11, 3, rank)) for rank in range(3)]
    assert sorted(i for share in shares for i in share) == list(range(11))
    assert [len(EvalShare(11, 3, rank)) for rank in range(3)] == [4, 4, 3]
    # A DistributedSampler, so Lightning keeps it instead of padding the split with repeats.
    assert isinstance(EvalShare(11, 3, 0), DistributedSampler)


def _clip_shares(rank: int, world: int, init_file: str, queue) -> None:
    import torch.distributed as dist

    from trainer.groups.clipping import GradientClipping, Percentile

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        full = torch.arange(1.0, 9.0)  # the whole gradient; each process holds half of it
        share = torch.nn.Parameter(torch.zeros(4))
        share.grad = full[rank * 4:(rank + 1) * 4].clone()
        rule = Percentile(calibration_steps=1)  # calibrated already, at a threshold of 2
        rule.load_state_dict({"calibration_norms": [2.0], "window": [], "calibrated_threshold": 2.0, "threshold": 2.0})
        clipping = GradientClipping(rule)
        norm, _, clipped = clipping.observe_and_clip([share], sharded=True)
        queue.put((rank, norm, clipped, share.grad.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_gradients_are_clipped_by_the_norm_of_all_shares(tmp_path):
    import torch.multiprocessing as mp

    context = mp.get_context("fork")  # the children need nothing but what this process has imported
    queue = context.Queue()
    processes = [context.Process(target=_clip_shares, args=(rank, 2, str(tmp_path / "init"), queue))
                 for rank in range(2)]
    for process in processes:
        process.start()
    results = sorted(queue.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    full = torch.arange(1.0, 9.0)
    whole_norm = float(full.norm())
    expected = (full * 2.0 / (whole_norm + 1e-6)).tolist()
    for rank, norm, clipped, grad in results:
        # Each process saw the norm of the whole gradient, not of its half, and scaled by the same factor.
        assert math.isclose(norm, whole_norm, rel_tol=1e-6) and clipped
        assert grad == pytest.approx(expected[rank * 4:(rank + 1) * 4], rel=1e-5)


def test_lightnings_child_processes_take_the_launch_time_of_rank_zero(monkeypatch):
    from datetime import datetime

    from trainer.infra.distributed import LAUNCH_TIME_ENV, shared_launch_time

    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(LAUNCH_TIME_ENV, "")  # unset for the code; monkeypatch removes it afterwards
    first = shared_launch_time()
    import os

    assert os.environ[LAUNCH_TIME_ENV] == first.isoformat()  # handed to the processes Lightning starts
    # Rank 0 reads its own clock again: a second run in the same process gets its own folder.
    monkeypatch.setenv(LAUNCH_TIME_ENV, "2026-01-02T03:04:05.678901")
    assert shared_launch_time() != datetime(2026, 1, 2, 3, 4, 5, 678901)
    # A child Lightning started (LOCAL_RANK=1) names everything from rank 0's time.
    monkeypatch.setenv(LAUNCH_TIME_ENV, "2026-01-02T03:04:05.678901")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert shared_launch_time() == datetime(2026, 1, 2, 3, 4, 5, 678901)
    monkeypatch.setenv(LAUNCH_TIME_ENV, "yesterday")
    with pytest.raises(UserError, match="TRAINER_LAUNCH_TIME: 'yesterday' is not an ISO time"):
        shared_launch_time()
