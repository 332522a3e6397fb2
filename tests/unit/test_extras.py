"""Which extra a feature needs, and the one line when it is missing (trainer/infra/extras.py); Hydra's
sweeper and launcher plugins, which fail while composing, say the same."""

from __future__ import annotations

import pytest
from hydra.errors import MissingConfigException

import trainer.infra.extras as extras
from trainer.configuration import hydra_setup
from trainer.infra.errors import UserError


def test_a_missing_module_names_its_extra_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "timm", ("timm", "no_such_module_here"))
    with pytest.raises(UserError) as raised:
        extras.require("timm", "model=timm")
    assert raised.value.line() == ("model=timm: needs the 'timm' extra (no_such_module_here not installed); "
                                   "allowed: pip install 'gpu-practice-trainer[timm]'")


def test_every_extra_is_installed_here():
    # make install installs them all, and so does CI: the suite tests every feature.
    assert {extra: extras.missing_modules(extra) for extra in extras.EXTRAS} == dict.fromkeys(extras.EXTRAS, [])


@pytest.mark.parametrize("missing, extra", [("hydra/sweeper/optuna", "sweeps"),
                                            ("hydra/launcher/submitit_slurm", "slurm")])
def test_a_missing_hydra_plugin_is_its_extra(monkeypatch, missing, extra):
    monkeypatch.setattr(hydra_setup, "missing_modules", lambda name: ["a module"] if name == extra else [])
    line = hydra_setup.describe_user_error(MissingConfigException(f"Could not find '{missing}'", missing))
    assert f"pip install 'gpu-practice-trainer[{extra}]'" in line
