"""The command line: `python train.py` in a checkout, `python -m trainer` or `gpu-practice-train`
where the package is installed. All three are this one Hydra entry point, composing the configs the
package carries (trainer/conf, trainer/recipes; a checkout shows them as conf/ and recipes/) and a
team folder's (trainer/configuration/recipes.py); `scaffold DIR` writes such a folder."""

import gc
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from trainer.configuration.hydra_setup import install as install_hydra_setup
from trainer.infra.command import subcommand

install_hydra_setup()


# An absolute folder, not "conf": from a module of a package Hydra would look for an importable
# `trainer.conf` package, which the configs are not.
@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parent / "conf"), config_name="train")
def train(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from trainer.phases.compose import made_by_this_job

    job = HydraConfig.get()
    run_dir = Path(job.runtime.output_dir)
    # Asked before anything is imported or logged: whether the folder Hydra has just made holds
    # nothing from before this job (a run refused before it trains then removes it).
    own_folder = made_by_this_job(run_dir)
    if job.mode != RunMode.MULTIRUN:  # a sweep's job reports its mistakes to the sweeper, through the run
        _refuse_early(cfg, run_dir, own_folder)
    # Imported here, once Hydra has composed and the early checks have passed: `--help` and a mistake
    # in the command line answer without importing torch and Lightning (several seconds).
    from trainer.run import run

    # The imports' several hundred thousand objects live as long as the process: frozen, they cost no GC
    # pass, and the interpreter's exit stops spending about a second traversing them (docs/measured.md).
    gc.freeze()
    return run(cfg, own_folder=own_folder)


def _refuse_early(cfg: DictConfig, run_dir: Path, own_folder: bool) -> None:
    """A value that the checks needing neither torch nor Lightning refuse (the top-level keys, run,
    target, the optimizer's own keys: trainer/configuration/early_checks.py) ends the command here,
    in the run's one line and exit code 2, its folder removed as the run would remove it."""
    from trainer.configuration.early_checks import check_before_imports
    from trainer.infra.distributed import is_rank_zero
    from trainer.infra.errors import UserError, one_line_on_user_error
    from trainer.phases.compose import remove_refused_run

    with one_line_on_user_error():
        try:
            check_before_imports(cfg)
        except UserError:
            if own_folder and is_rank_zero():
                remove_refused_run(run_dir, cfg)
            raise


def main() -> None:
    """`scaffold DIR` writes a starter team folder (trainer/scaffold.py), `deploy ...` is
    `python -m trainer.deploy ...` (trainer/deploy/__main__.py); anything else is a run."""
    if sys.argv[1:2] == ["scaffold"]:
        from trainer.scaffold import main as scaffold

        scaffold(sys.argv[2:])
    elif sys.argv[1:2] == ["deploy"]:
        from trainer.deploy.__main__ import main as deploy

        deploy(sys.argv[2:], prog=subcommand("deploy"))
    else:
        train()
