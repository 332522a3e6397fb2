"""The `trainer` group made into the Lightning Trainer (trainer/groups/trainer.py, build.build_trainer):
an argument given as `{_target_: ...}` reaches Lightning as the object it names; a target that does
not import, or whose constructor refuses its arguments, is one line naming the key; the person's
plugins are added after the framework's, and precision and CheckpointIO plugins are refused; and
every value Lightning refuses while the Trainer is built (or would fail on once fit starts) is a
UserError naming `trainer.<that key>`, checked by throwing bad values at every Trainer argument.

The Trainer is built in this process by the run's own functions (validate, resolve, build_trainer),
from one tiny composed config whose data module and network are built once."""

from __future__ import annotations

import copy
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.profilers import SimpleProfiler
from omegaconf import OmegaConf

from tests.helpers import ON_CPU, TINY, compose, prepared_run
from trainer.configuration.spec import choice_config, validate
from trainer.infra.checkpoint_io import SafeCheckpointIO
from trainer.groups.clipping import GradientClipping, Off
from trainer.groups.communication import UNCOMPRESSED
from trainer.groups.trainer import TRAINER_KEYS_OWNED_ELSEWHERE
from trainer.infra.devices import decide_devices
from trainer.infra.errors import UserError
from trainer.phases.build import _trainer_arguments, build_trainer
from trainer.phases.plan import decide_probe, resolve
from trainer.phases.products import Built


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[dict[str, Any], Any]:
    plain = OmegaConf.to_container(compose([*TINY, *ON_CPU]), resolve=True)
    plain.pop("hydra", None)
    return plain, prepared_run(plain, tmp_path_factory.mktemp("run"))


def build(setup, **trainer: Any) -> Built:
    """validate -> the devices -> resolve -> build_trainer, as a run does, with `trainer` set under
    trainer.* (the parts built once)."""
    plain, prepared = setup
    plain = copy.deepcopy(plain)
    plain["trainer"].update(trainer)
    run = copy.copy(prepared)
    run.spec = validate(plain)
    run.devices = decide_devices(run.spec.trainer)
    run.plan = resolve(run.spec, decide_probe(run.spec, run.devices, run.parts), run.parts)
    return build_trainer(run)


def error_of(setup, **trainer: Any) -> UserError:
    with pytest.raises(UserError) as caught:
        build(setup, **trainer)
    return caught.value


# --- nested _target_ ---------------------------------------------------------------------------------
def test_a_nested_target_reaches_lightning_as_the_object_it_names(setup):
    built = build(setup, profiler={"_target_": "lightning.pytorch.profilers.SimpleProfiler", "filename": "perf"})
    assert isinstance(built.trainer.profiler, SimpleProfiler)
    assert built.trainer.profiler.filename == "perf"


def test_a_strategy_given_as_a_target_is_that_strategy(setup):
    built = build(setup, strategy={"_target_": "lightning.pytorch.strategies.SingleDeviceStrategy", "device": "cpu"})
    assert type(built.trainer.strategy).__name__ == "SingleDeviceStrategy"
    assert isinstance(built.trainer.strategy.checkpoint_io, SafeCheckpointIO)


def test_a_nested_target_that_does_not_import_is_one_line(setup):
    error = error_of(setup, strategy={"_target_": "lightning.pytorch.strategies.NoSuchStrategy"})
    assert error.where == "trainer.strategy._target_" and "has no attribute 'NoSuchStrategy'" in error.line()
    assert "\n" not in error.line()


def test_a_nested_key_its_constructor_lacks_is_one_line(setup):
    error = error_of(setup, profiler={"_target_": "lightning.pytorch.profilers.SimpleProfiler", "filenam": "x"})
    assert error.where == "trainer.profiler.filenam" and "filename" in error.allowed


def test_a_nested_constructor_that_refuses_its_arguments_is_one_line(setup):
    error = error_of(setup, profiler={"_target_": "lightning.pytorch.profilers.PyTorchProfiler",
                                      "sort_by_key": "nonsense"})
    assert error.where == "trainer.profiler" and "rejected its arguments" in error.problem


def test_a_nested_target_of_the_wrong_kind_is_one_line(setup):
    error = error_of(setup, profiler={"_target_": "lightning.pytorch.callbacks.Timer"})
    assert error.where == "trainer.profiler._target_" and "built a Timer, not Profiler" in error.problem


# --- plugins -----------------------------------------------------------------------------------------
def test_the_persons_plugins_are_added_to_the_frameworks(setup):
    built = build(setup, plugins=[
        {"_target_": "lightning.pytorch.plugins.environments.SLURMEnvironment", "auto_requeue": False},
        {"_target_": "lightning.pytorch.plugins.TorchSyncBatchNorm"}])
    connector = built.trainer._accelerator_connector
    assert isinstance(connector.cluster_environment, SLURMEnvironment)
    assert connector.cluster_environment.auto_requeue is False
    assert isinstance(connector._layer_sync, TorchSyncBatchNorm)
    # The framework's checkpoint writer is still the one every checkpoint goes through.
    assert isinstance(built.trainer.strategy.checkpoint_io, SafeCheckpointIO)


def test_the_trainer_is_given_the_devices_the_run_decided(setup):
    # trainer.devices=auto is counted once, by the run (trainer/infra/devices.py): Lightning gets the
    # count every phase before it used, not "auto" to resolve again.
    built = build(setup, devices="auto")
    assert built.trainer.num_devices == 1
    plain, prepared = setup
    run = copy.copy(prepared)
    run.spec = validate({**plain, "trainer": {**plain["trainer"], "devices": "auto"}})
    run.devices = decide_devices(run.spec.trainer)
    run.plan = resolve(run.spec, decide_probe(run.spec, run.devices, run.parts), run.parts)
    assert _trainer_arguments(run.spec, run.plan, GradientClipping(Off()))["devices"] == 1


def test_under_slurm_lightnings_own_requeue_is_off_unless_the_person_sets_an_environment(setup, monkeypatch):
    # Inside a SLURM job (as submitit starts one), Lightning would requeue on SIGUSR1 by itself and
    # restore its own hpc checkpoint; preemption is submitit's and GracefulStop's here.
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "vm"}.items():
        monkeypatch.setenv(key, value)
    environment = build(setup).trainer._accelerator_connector.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue is False
    chosen = build(setup, plugins=[{"_target_": "lightning.pytorch.plugins.environments.SLURMEnvironment",
                                    "auto_requeue": True}]).trainer._accelerator_connector.cluster_environment
    assert chosen.auto_requeue is True  # the person's own choice stands


def test_the_persons_plugins_follow_the_fp16_precision_plugin_and_the_checkpoint_writer(monkeypatch):
    # On CUDA, fp16 brings the framework's own precision plugin (with its GradScaler): a plugin the
    # person adds must not replace it, nor be replaced by it. Without a GPU, pretend CUDA is there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = types.SimpleNamespace(trainer={"plugins": [{"_target_": "x.Env"}], "benchmark": None},
                                 precision=choice_config("precision", "fp16_mixed"))
    plan = types.SimpleNamespace(precision="16-mixed", accelerator="cuda", tf32=True, cudnn_benchmark=True,
                                 slurm_environment=False, communication=UNCOMPRESSED,
                                 probe=types.SimpleNamespace(devices=types.SimpleNamespace(trainer_devices=1)))
    plugins = _trainer_arguments(spec, plan, GradientClipping(Off()))["plugins"]
    assert [type(p).__name__ for p in plugins[:2]] == ["MixedPrecision", "SafeCheckpointIO"]
    assert plugins[2] == {"_target_": "x.Env"}


@pytest.mark.parametrize("target, pointer", [
    ("lightning.pytorch.plugins.MixedPrecision", "precision group"),
    ("lightning.pytorch.plugins.precision.DoublePrecision", "precision group"),
    ("lightning.pytorch.plugins.TorchCheckpointIO", "checkpointing group"),
    ("lightning.pytorch.plugins.AsyncCheckpointIO", "checkpointing group"),
    ("torch.nn.Identity", "ClusterEnvironment"),
])
def test_precision_and_checkpoint_io_plugins_are_refused_with_a_pointer(target, pointer):
    with pytest.raises(UserError) as caught:
        validate(compose([*ON_CPU, f"+trainer.plugins=[{{_target_: {target}}}]"]))
    assert caught.value.where == "trainer.plugins[0]._target_"
    assert pointer in caught.value.allowed


# --- what Lightning refuses ----------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, text", [
    ("max_epochs", -2, "non-negative integer or -1"),
    ("max_steps", -5, "non-negative integer or -1"),
    ("limit_train_batches", -0.5, "has to be in [0.0, 1.0]"),
    ("devices", "junk", "'junk' names no devices"),  # refused by the run's own count, which the Trainer is given
    ("strategy", "junk", "invalid strategy name"),
    ("profiler", "junk", "can only be one of"),
    ("max_time", "junk", "not a valid duration"),
    # Lightning's message names barebones together with the framework's logger: the key the person
    # set is the one named.
    ("barebones", True, "disabled in barebones mode"),
])
def test_a_value_lightning_refuses_is_one_line_naming_its_key(setup, key, value, text):
    error = error_of(setup, **{key: value})
    assert error.where == f"trainer.{key}" and text in error.problem
    assert "\n" not in error.line() and "`" not in error.line()


@pytest.mark.parametrize("key, value", [
    # Lightning accepts these when the Trainer is built and divides by them once fit starts.
    ("accumulate_grad_batches", 0), ("check_val_every_n_epoch", 0), ("val_check_interval", 0),
    # ... or reads these negative counts as "always"; num_nodes also feeds the batch rules first.
    ("accumulate_grad_batches", -1), ("log_every_n_steps", -1), ("num_nodes", 0), ("min_epochs", -3),
    ("num_sanity_val_steps", -5),
])
def test_a_value_lightning_fails_on_only_once_fit_starts_is_refused_up_front(key, value):
    with pytest.raises(UserError) as caught:
        validate(compose([*ON_CPU, f"++trainer.{key}={value}"]))
    assert caught.value.where == f"trainer.{key}" and "must be >=" in caught.value.problem


def test_two_values_refused_only_together_are_named_together(setup):
    error = error_of(setup, val_check_interval=0.5, check_val_every_n_epoch=None)
    assert error.where in ("trainer.val_check_interval", "trainer.check_val_every_n_epoch")
    assert "cannot be combined with trainer." in error.problem


def test_a_refused_trainer_leaves_the_process_flags_as_they_were(setup):
    # The next job of a sweep must not inherit determinism from a Trainer that was never made: the
    # refused one and each trial that looked for the key at fault set it before failing.
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    assert error_of(setup, deterministic=True, max_epochs=-2).where == "trainer.max_epochs"
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before


# --- bad values at every Trainer argument ----------------------------------------------------------------
#: Every key of conf/trainer/default.yaml, and the other Trainer arguments a person may set.
DEFAULT_KEYS = list(OmegaConf.load(Path(__file__).parents[2] / "conf" / "trainer" / "default.yaml"))
OTHER_KEYS = ["strategy", "min_epochs", "min_steps", "max_time", "limit_predict_batches", "overfit_batches",
              "val_check_interval", "fast_dev_run", "enable_model_summary", "inference_mode", "profiler",
              "detect_anomaly", "barebones", "plugins", "sync_batchnorm", "reload_dataloaders_every_n_epochs",
              "use_distributed_sampler", "enable_autolog_hparams", *TRAINER_KEYS_OWNED_ELSEWHERE]
TRAINER_KEYS = list(dict.fromkeys(DEFAULT_KEYS + OTHER_KEYS))

BAD_VALUES = st.one_of(
    st.integers(min_value=-10**6, max_value=0),                      # zero and negative counts
    st.sampled_from([-1, -2, 0, 2, 10**4]),                           # edges and large values
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 0 <= x <= 1),  # out of range
    st.floats(min_value=-2.0, max_value=2.0),
    st.text(max_size=12),                                              # junk strings
    st.sampled_from(["", "auto", "none", "-1", "0", "1,1", "true", "DD:HH", "00:00:00:01", "cpu,gpu"]),
    st.booleans(), st.none(),                                          # wrong types
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.sampled_from(["a", "hours", "_target_"]), st.sampled_from([1, "x", "torch.nn.Identity"]),
                    max_size=2),
)


@pytest.mark.parametrize("key", TRAINER_KEYS)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=BAD_VALUES)
def test_any_value_at_any_trainer_key_builds_or_is_one_line_naming_that_key(setup, key, value):
    try:
        built = build(setup, **{key: value})
    except UserError as error:
        assert error.where == f"trainer.{key}" or error.where.startswith((f"trainer.{key}.", f"trainer.{key}[")), \
            error.line()
        assert "\n" not in error.line()
    else:
        assert built.trainer is not None
