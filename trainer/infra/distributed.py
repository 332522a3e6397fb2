"""Several processes, one run: who starts them, which of them writes, and one launch time for all.

Lightning's strategies do the training; one run folder and rank 0 writing are described in
docs/scale-out.md. The processes come from Lightning (its first process re-runs the script with
``hydra.run.dir`` and ``TRAINER_LAUNCH_TIME`` in the environment), from torchrun or a plain srun
(each rank its own Hydra run: `SharedLaunchTime` sets up the process group before the folder is
resolved and takes rank 0's clock), or from Hydra's submitit launcher (the sweep folder is resolved
once where the job is submitted and travels with each job's config)."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from trainer.infra.command import invoked_as
from trainer.infra.errors import UserError

log = logging.getLogger("trainer")

LAUNCH_TIME_ENV = "TRAINER_LAUNCH_TIME"


def launched_by(env: Mapping[str, str] | None = None) -> str | None:
    """The external launcher that started this process as one of several: ``torchrun``,
    ``slurm`` (srun with more than one task), or None (a single process, or Lightning's own)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env and int(env.get("WORLD_SIZE", "1")) > 1:
        return "torchrun"
    # As Lightning's SLURMEnvironment.detect: an interactive allocation's shell is not a task.
    if (int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env
            and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")):
        return "slurm"
    return None


def process_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher gave it, before any process group exists; 0 for a
    single process and for the first process of Lightning's own launch."""
    env = os.environ if env is None else env
    if "RANK" in env:  # torchrun, or Lightning once it has set up the group
        return int(env["RANK"])
    if launched_by(env) == "slurm":
        return int(env["SLURM_PROCID"])
    # Lightning's launcher: LOCAL_RANK in its children, NODE_RANK on the further nodes.
    local, node = int(env.get("LOCAL_RANK", "0")), int(env.get("NODE_RANK", env.get("GROUP_RANK", "0")))
    return local if node == 0 else max(1, node)  # only whether it is 0 matters before the group exists


def is_rank_zero(env: Mapping[str, str] | None = None) -> bool:
    return process_rank(env) == 0


def rank_zero_record(record: Path, needs: Sequence[str], key: str, asked: str, instead: str,
                     timeout_s: float = 600.0) -> dict[str, Any]:
    """What rank 0 decided and wrote to the JSON file `record` (atomically, holding the keys in
    `needs`), once it is there: a choice each rank could make differently (a measured batch, a
    found lr) is rank 0's on every rank. After `timeout_s` without it, a UserError naming `key`
    (`asked`: its value, e.g. auto; `instead`: what to do)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = json.loads(record.read_text())
            if isinstance(found, dict) and all(name in found for name in needs):
                return found
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise UserError(key, f"{asked}: rank 0 wrote no {record} within {timeout_s:.0f} s", instead)


def check_launch(processes: int, multirun: bool, launcher_target: str, strategy: Any = "auto",
                 accelerator: str = "cpu", env: Mapping[str, str] | None = None) -> None:
    """Refuse, before anything starts, the combinations that would not give one run per job (which
    strategies diagnose=true and profile=true can measure: trainer.groups.communication.check_measurable)."""
    if isinstance(strategy, str) and strategy.startswith("fsdp") and accelerator != "cuda":
        # Lightning's own check would stop the run later, with a traceback.
        raise UserError("trainer.strategy", f"'{strategy}' (Lightning's FSDPStrategy) runs on CUDA GPUs only, "
                        f"and this run's accelerator is {accelerator}",
                        "trainer=ddp on any device, or trainer=fsdp on a machine with GPUs")
    env = os.environ if env is None else env
    launcher = launched_by(env)
    if launcher is not None:
        started = int(env["WORLD_SIZE"] if launcher == "torchrun" else env["SLURM_NTASKS"])
        if started != processes:
            raise UserError("trainer.devices", f"{launcher} started {started} processes but the config trains "
                            f"on {processes} (devices x num_nodes)",
                            f"trainer.devices and trainer.num_nodes whose product is {started}")
    if processes <= 1 or not multirun:
        return
    if "submitit" in launcher_target and "slurm" in launcher_target.lower() and launcher == "slurm":
        return  # each job is an srun of one task per device: Lightning's SLURM environment
    raise LaunchRefused(
        "trainer.devices", f"{processes} processes per job inside a Hydra multirun started here: the extra "
        "processes would each re-run the whole sweep (Lightning re-runs the command; torchrun and srun start "
        "the sweep in every rank)",
        "-m hydra/launcher=slurm (one SLURM task per device per job), or one run per command "
        f"(for v in ...; do {invoked_as()} trainer=ddp key=$v; done)")


class LaunchRefused(UserError):
    """A launch that cannot work for any job of a sweep: it ends the whole multirun, not one job."""


class SharedLaunchTime(Callback):
    """Hydra callback (conf/train.yaml): every rank resolves ``${now:...}`` to one time, rank 0's.
    Hydra registers ``now`` itself at start-up and resolves the run folder after ``on_run_start``,
    so replacing the resolver here decides the folder name. Ranks other than 0 also drop Hydra's
    ``.hydra/`` copy and the log file: rank 0 writes both in the shared folder."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        stamp = shared_launch_time(config.get("trainer"))
        OmegaConf.register_new_resolver("now", lambda pattern: stamp.strftime(pattern), use_cache=True,
                                        replace=True)
        if not is_rank_zero():
            quiet_hydra_outputs(config)


def quiet_hydra_outputs(config: DictConfig) -> None:
    """No ``.hydra/`` folder and no log file for this process: console only."""
    with open_dict(config):
        config.hydra.output_subdir = None
        logging_cfg = config.hydra.job_logging
        handlers = logging_cfg.get("handlers") or {}
        if "file" in handlers:
            del logging_cfg.handlers["file"]
        root = logging_cfg.get("root")
        if root is not None and "handlers" in root:
            root.handlers = [h for h in root.handlers if h != "file"]


def shared_launch_time(trainer_cfg: Any = None) -> datetime:
    """The launch time all ranks agree on, kept in ``TRAINER_LAUNCH_TIME`` for the processes this
    one starts (Lightning's launcher copies the environment into them). Rank 0 always reads its
    own clock, so a second run in the same process gets a folder of its own."""
    given = os.environ.get(LAUNCH_TIME_ENV)
    if given and not is_rank_zero():
        try:
            return datetime.fromisoformat(given)
        except ValueError:
            raise UserError(LAUNCH_TIME_ENV, f"'{given}' is not an ISO time",
                            "unset, or a time such as 2026-11-29T21:30:00.123456") from None
    stamp = datetime.now()
    if launched_by() is not None:
        stamp = _rank_zero_time(stamp, trainer_cfg)
    os.environ[LAUNCH_TIME_ENV] = stamp.isoformat()
    return stamp


def _rank_zero_time(stamp: datetime, trainer_cfg: Any) -> datetime:
    """Rank 0's time, through the key-value store of the process group this sets up now. Lightning
    then finds the group ready and uses it instead of making its own (``_init_dist_connection``),
    so the group gets the backend Lightning would choose: NCCL for CUDA devices, else gloo."""
    # torch and Lightning only here: this module is a Hydra callback, imported by every
    # `python train.py` before it composes (an error or --help should not pay for them).
    import torch
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    environment = TorchElasticEnvironment() if launched_by() == "torchrun" else SLURMEnvironment()
    rank, world = environment.global_rank(), environment.world_size()
    if dist.is_initialized():  # set up by the person's own code: nothing to share the time through
        return stamp
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world))
    accelerator = str((trainer_cfg or {}).get("accelerator", "auto")).lower()
    backend = "nccl" if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    # torchrun's store outlives a restart of the workers: one key per attempt.
    key = f"trainer/launch_time/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        store.set(key, stamp.isoformat())  # rank 0's wall clock as it reads it
        return stamp
    return datetime.fromisoformat(store.get(key).decode())
