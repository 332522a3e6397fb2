"""trainer.gradient_compression: the config turned into Lightning's DDPStrategy with torch's hook and
state (what else the strategy config says kept), the refusals in one line each, and the decision in
the plan; and the all-reduce as profile=true's communication category, with the operator names a
profiled two-process gloo step really has. The training itself with two processes is
tests/run/test_ddp_compression.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from tests.helpers import compose, planned_run
from trainer.configuration.spec import validate
from trainer.groups.communication import (UNCOMPRESSED, Communication, CompressedDDPStrategy, communication_of, compressed_ddp, decide,
                                          strategy_target)
from trainer.groups.trainer import make_trainer
from trainer.infra.errors import UserError
from trainer.measure.profile import COMMUNICATION, category_of


def _comm(choice: str, rank: int = 2, start: int = 1000) -> Communication:
    return Communication(choice, rank, start)


def test_default_config_compresses_nothing_and_keeps_the_keys_out_of_the_trainer_arguments():
    spec = validate(compose(["trainer=ddp"]))
    assert spec.communication == UNCOMPRESSED
    assert not {"gradient_compression", "powersgd_rank", "powersgd_start_step"} & set(spec.trainer)
    # A config saved before the keys existed validates as uncompressed.
    assert communication_of({"max_epochs": 3}) == UNCOMPRESSED


def test_the_keys_are_read_from_the_trainer_group():
    spec = validate(compose(["trainer=ddp", "trainer.gradient_compression=powersgd", "trainer.powersgd_rank=4",
                             "trainer.powersgd_start_step=50"]))
    assert spec.communication == _comm("powersgd", 4, 50)


@pytest.mark.parametrize("override, key, says", [
    ("trainer.powersgd_rank=0", "trainer.powersgd_rank", "at least rank 1"),
    ("trainer.powersgd_start_step=1", "trainer.powersgd_start_step", ">= 2"),
    ("trainer.gradient_compression=int8", "trainer.gradient_compression", "powersgd"),
])
def test_bad_values_are_refused_naming_the_key(override, key, says):
    with pytest.raises(UserError) as refused:
        validate(compose(["trainer=ddp", override]))
    line = str(refused.value)
    assert line.startswith(f"{key}:") and says in line and "\n" not in line


def test_fp16_on_ddp_alias_keeps_the_alias_arguments_and_registers_torchs_hook():
    strategy = compressed_ddp("ddp_find_unused_parameters_true", "fp16", 2, 1000)
    assert type(strategy) is CompressedDDPStrategy
    assert strategy._ddp_comm_hook is default_hooks.fp16_compress_hook
    assert strategy._ddp_comm_state is None
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy._start_method == "popen"


def test_bf16_hook():
    assert compressed_ddp("ddp", "bf16", 2, 1000)._ddp_comm_hook is default_hooks.bf16_compress_hook


def test_powersgd_gets_a_fresh_state_with_the_rank_and_start_step_per_strategy():
    first = compressed_ddp("ddp", "powersgd", 3, 40)
    second = compressed_ddp("ddp", "powersgd", 3, 40)
    assert first._ddp_comm_hook is powerSGD_hook.powerSGD_hook
    state = first._ddp_comm_state
    assert isinstance(state, powerSGD_hook.PowerSGDState)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.use_error_feedback) == (3, 40, True)
    assert state.process_group is None  # the default group, set up once the processes start
    assert second._ddp_comm_state is not state  # error feedback is one run's


def test_a_target_mapping_keeps_its_arguments():
    target = {"_target_": "lightning.pytorch.strategies.DDPStrategy", "process_group_backend": "gloo",
              "find_unused_parameters": True}
    strategy = compressed_ddp(target, "fp16", 2, 1000)
    assert strategy.process_group_backend == "gloo"
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy._ddp_comm_hook is default_hooks.fp16_compress_hook


def test_auto_on_two_processes_is_lightnings_ddp():
    assert decide(_comm("fp16"), "auto", 2, "cpu").compression == "fp16"
    assert type(compressed_ddp("auto", "fp16", 2, 1000)) is CompressedDDPStrategy


def test_the_trainer_is_made_with_the_compressed_strategy_fresh_each_time():
    target = strategy_target(_comm("powersgd", 1, 10), "ddp")
    trainers = [make_trainer(["strategy"], strategy=target, accelerator="cpu", devices=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False) for _ in range(2)]
    states = [trainer.strategy._ddp_comm_state for trainer in trainers]
    assert all(isinstance(trainer.strategy, DDPStrategy) for trainer in trainers)
    assert trainers[0].strategy._ddp_comm_hook is powerSGD_hook.powerSGD_hook
    assert states[0].matrix_approximation_rank == 1 and states[0] is not states[1]


@pytest.mark.parametrize("strategy, processes, says", [
    ("ddp", 1, "one process"),
    ("auto", 1, "one process"),
    ("fsdp", 2, "not Lightning's DDPStrategy"),
    ("deepspeed_stage_2", 2, "not Lightning's DDPStrategy"),
    ({"_target_": "lightning.pytorch.strategies.FSDPStrategy"}, 2, "not Lightning's DDPStrategy"),
    ({"_target_": "trainer.groups.communication.CompressedDDPStrategy"}, 2, "a subclass of it"),
])
def test_compression_without_a_ddp_strategy_is_refused(strategy, processes, says):
    with pytest.raises(UserError) as refused:
        decide(_comm("fp16"), strategy, processes, "cpu")
    line = str(refused.value)
    assert line.startswith("trainer.gradient_compression:") and says in line and "allowed: none" in line


def test_the_hook_is_registered_on_cpu_processes_too(monkeypatch):
    """Lightning's DDPStrategy registers a hook on CUDA only; on gloo CPU processes it would train
    uncompressed without a word."""
    registered = []
    monkeypatch.setattr("trainer.groups.communication._register_ddp_comm_hook",
                        lambda **kwargs: registered.append(kwargs))
    strategy = compressed_ddp("ddp", "fp16", 2, 1000)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.model = object.__new__(torch.nn.parallel.DistributedDataParallel)
    strategy._register_ddp_hooks()
    assert registered and registered[0]["ddp_comm_hook"] is default_hooks.fp16_compress_hook


def test_bf16_all_reduces_on_gloo_and_is_refused_where_nccl_cannot():
    # gloo all-reduces bfloat16 on torch 2.14's CPU build (two processes checked while writing this).
    assert decide(_comm("bf16"), "ddp", 2, "cpu").backend == "gloo"
    with pytest.raises(UserError, match="allowed: fp16, powersgd or none"):
        decide(_comm("bf16"), {"_target_": "lightning.pytorch.strategies.DDPStrategy",
                               "process_group_backend": "mpi"}, 2, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="NCCL >= 2.10"):
            decide(_comm("bf16"), "ddp", 2, "cuda")


def test_a_run_refuses_compression_on_one_process_before_building(tmp_path):
    with pytest.raises(UserError, match="^trainer.gradient_compression: fp16 .* one process"):
        planned_run(compose(["trainer.accelerator=cpu", "trainer.gradient_compression=fp16"]), tmp_path)


def test_powersgd_is_refused_on_gloo_and_described_on_nccl():
    """gloo aborts PowerSGD's chained all-reduces of several buckets (seen with plain torch DDP)."""
    with pytest.raises(UserError, match="^trainer.gradient_compression: powersgd on gloo.*allowed: fp16, bf16 or none"):
        decide(_comm("powersgd"), "ddp", 2, "cpu")
    on_nccl = decide(_comm("powersgd", 2, 20), "ddp", 4, "cuda")
    assert on_nccl.backend == "nccl"
    assert "rank-2" in on_nccl.how and "before step 20" in on_nccl.how and "4 processes on nccl" in on_nccl.how


def test_the_plan_records_the_decision(tmp_path):
    run = planned_run(compose(["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
                               "trainer.gradient_compression=fp16"]), tmp_path)
    derived = run.plan.derived["trainer.gradient_compression"]
    assert derived.value == "fp16"
    assert "fp16_compress_hook" in derived.how and "2 processes on gloo" in derived.how
    assert run.plan.communication == _comm("fp16")
    uncompressed = planned_run(compose(["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu"]), tmp_path)
    assert uncompressed.plan.derived["trainer.gradient_compression"].how == "fp32 all-reduce"


# -- the all-reduce in profile=true's categories -------------------------------------------------------

@pytest.mark.parametrize("name", [
    # Recorded by torch.profiler around a two-process gloo DDP step (torch 2.14, the test below).
    "c10d::allreduce_", "gloo:all_reduce", "c10d::broadcast_", "gloo:broadcast",
    "torch.distributed.ddp.reducer::copy_bucket_to_grad", "torch::distributed::reducer::mul_out",
    # NCCL's names for the same (the record function and its kernels).
    "nccl:all_reduce", "record_param_comms", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    "ncclKernel_AllReduce_RING_LL_Sum_float",
])
def test_collectives_are_the_communication_category(name):
    assert category_of(name) == COMMUNICATION


def test_reductions_of_the_model_stay_reductions():
    assert category_of("aten::sum") != COMMUNICATION and category_of("aten::nll_loss_forward") != COMMUNICATION


def _profile_ddp_step(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    net = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        for _ in range(2):
            net(torch.randn(8, 32)).sum().backward()
    if rank == 0:
        Path(out).write_text("\n".join(sorted({event.key for event in recorded.key_averages()})))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_profiled_gloo_ddp_step_shows_its_all_reduce_as_communication(tmp_path):
    """Two processes (a few seconds): the names torch.profiler really gives the gradient all-reduce.
    Forked from this process (each sets one thread first), not spawned: two spawned interpreters
    imported this module, and with it torch and Lightning, again (~12 s of CPU)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "names.txt"
    mp.start_processes(_profile_ddp_step, args=(port, str(out)), nprocs=2, start_method="fork")
    names = out.read_text().splitlines()
    communication = {name for name in names if category_of(name) == COMMUNICATION}
    assert {"c10d::allreduce_", "gloo:all_reduce"} <= communication, names
    assert not {name for name in communication if name.startswith("aten::")}
