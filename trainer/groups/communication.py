"""Gradient compression for data-parallel training: the `trainer` group's keys
``gradient_compression``, ``powersgd_rank`` and ``powersgd_start_step``, turned into one of torch's
DDP communication hooks (fp16, bf16, PowerSGD; docs/scale-out.md, "Gradient compression").

The choice needs a DDP strategy with more than one process; `decide` refuses the rest in one line and
says what will run; `compressed_ddp` makes the strategy, fresh for each Trainer (a PowerSGD state
holds per-run error feedback and must not be shared). The strategy is `CompressedDDPStrategy`:
Lightning's DDPStrategy registers a communication hook on CUDA devices only (a torch 1.8 limit), and
would otherwise drop it without a word on CPU processes, where gloo runs these hooks fine."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any, Callable, Literal, Mapping, Optional

import torch
from hydra.utils import instantiate
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry, XLAStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from trainer.infra.errors import UserError
from trainer.infra.schema import Doc, Range, check_keys, locate_target

Compression = Literal["none", "fp16", "bf16", "powersgd"]
#: The NCCL release from which NCCL all-reduces bfloat16 (torch's bf16_compress_hook requires it).
NCCL_BF16 = (2, 10)


@dataclass(frozen=True)
class Communication:
    """What the DDP processes send each other when they average gradients (trainer/groups/communication.py)."""

    gradient_compression: Annotated[Compression, Doc(
        "DDP gradient all-reduce: none (fp32), fp16 or bf16 (half the bytes), powersgd (low-rank, error "
        "feedback); needs trainer=ddp with more than one process")]
    # Vogels et al. 2019 match full-precision SGD's accuracy on ResNet-18/CIFAR-10 at rank 2; torch's
    # docs advise starting at 1 and doubling until accuracy holds. 2 is the paper's measured default.
    powersgd_rank: Annotated[int, Doc("PowerSGD: rank of each gradient matrix's approximation (1-4 usual; "
                                      "higher: less compression, closer to the full gradient)")]
    # torch's PowerSGDState default; its docs advise ~10% of the run's steps, at least the warm-up's.
    powersgd_start_step: Annotated[int, Range(ge=2), Doc(
        "PowerSGD: plain all-reduce before this step (at least 2: DDP rebuilds its buckets after step 1)")]

    def check(self, group: str = "trainer") -> None:
        if self.powersgd_rank < 1:
            raise UserError(f"{group}.powersgd_rank", f"{self.powersgd_rank}: PowerSGD approximates each gradient "
                            "by a matrix of at least rank 1", "an integer >= 1 (1-4 usual; 2 by default)")


#: The trainer group's keys this module owns (they are not arguments of lightning.Trainer).
KEYS: tuple[str, ...] = tuple(f.name for f in fields(Communication))


#: A `trainer` mapping without any of the keys (a run's config saved before they existed): no compression.
UNCOMPRESSED = Communication("none", 2, 1000)


def communication_of(values: Mapping[str, Any]) -> Communication:
    """The compression keys of the `trainer` mapping, checked (the rest are the Trainer's)."""
    if not any(key in values for key in KEYS):
        return UNCOMPRESSED
    return check_keys("trainer", {key: values[key] for key in KEYS if key in values}, Communication)


@dataclass(frozen=True)
class Decision:
    """What the gradient all-reduce of a run will be: the choice and how it was derived."""

    compression: str
    how: str
    #: The process-group backend the all-reduce runs on (None: a single process).
    backend: Optional[str] = None


def decide(communication: Communication, strategy: Any, processes: int, accelerator: str) -> Decision:
    """The run's gradient communication; a choice the run cannot honour ends in one line naming the key."""
    choice = communication.gradient_compression
    if choice == "none":
        return Decision("none", "fp32 all-reduce" if processes > 1 else "one process: no all-reduce")
    key = "trainer.gradient_compression"
    name = _strategy_name(strategy)
    if processes <= 1:
        raise UserError(key, f"{choice} compresses the gradient all-reduce between processes, and this run trains "
                        f"in one process", "none, or trainer=ddp trainer.devices=N (N >= 2)")
    cls = _strategy_class(strategy, processes)
    if cls is None or not _is_plain_ddp(cls):
        raise UserError(key, f"{choice} is a DDP communication hook, and trainer.strategy={name} is not Lightning's "
                        "DDPStrategy (FSDP and DeepSpeed communicate in their own ways)",
                        "none, or trainer=ddp (a ddp* strategy or {_target_: lightning.pytorch.strategies.DDPStrategy})")
    if cls is not DDPStrategy:
        # The hook goes in through CompressedDDPStrategy, a DDPStrategy: a subclass of the person's own
        # would lose its overrides.
        raise UserError(key, f"{choice} is registered through the framework's DDPStrategy, and trainer.strategy="
                        f"{name} is a subclass of it", "none, or trainer.strategy=ddp (or {_target_: "
                        "lightning.pytorch.strategies.DDPStrategy} with its arguments)")
    backend = _backend(strategy, accelerator)
    if choice == "bf16":
        _check_bf16(backend)
    if choice == "powersgd" and backend == "gloo":
        # Seen here with torch 2.14, plain DDP without Lightning: with more than one gradient bucket the
        # hook's chained all-reduces reach gloo's worker threads in a different order on each process,
        # and gloo aborts ("Received data size doesn't match expected size").
        raise UserError(key, "powersgd on gloo: its chained all-reduces of several gradient buckets arrive out of "
                        "order between processes and gloo aborts the run", "fp16, bf16 or none on gloo; powersgd "
                        "on nccl (CUDA devices)")
    hooks = {"fp16": "fp16_compress_hook: each gradient bucket cast to fp16 for the all-reduce (half the bytes)",
             "bf16": "bf16_compress_hook: each gradient bucket cast to bf16 for the all-reduce (half the bytes)",
             "powersgd": f"powerSGD_hook: rank-{communication.powersgd_rank} approximation of each gradient matrix "
                         f"with error feedback, plain all-reduce before step {communication.powersgd_start_step}"}
    return Decision(choice, f"{hooks[choice]}; {processes} processes on {backend}", backend)


def check_measurable(strategy: Any, processes: int, measuring: str) -> None:
    """diagnose=true and profile=true (`measuring`) on several processes: Lightning's DDP whose every
    process runs the script (each measures the same steps, rank 0 reports). Anything else ends in one
    line naming `measuring`."""
    if processes <= 1:
        return
    name = _strategy_name(strategy)
    cls = _strategy_class(strategy, processes)
    if cls is None or not _is_plain_ddp(cls):
        raise UserError(measuring, f"measures one process or Lightning's DDP, and trainer.strategy={name} is neither: "
                        "FSDP and DeepSpeed shard the model and gather its weights inside forward and backward, which "
                        "the one-process timings cannot separate from the arithmetic",
                        "trainer=ddp, or trainer.devices=1 trainer.num_nodes=1")
    start = _start_method(strategy)
    if start != "popen":
        raise UserError(measuring, f"trainer.strategy={name} starts its processes from inside fit ({start}), and the "
                        "measurement runs in the processes that run the script",
                        "trainer=ddp (Lightning re-runs the script for each process), or torchrun / srun")


def _start_method(strategy: Any) -> str:
    """How a DDP strategy starts its processes: popen (each runs the script), spawn, fork."""
    if isinstance(strategy, Mapping):
        return str(strategy.get("start_method", "popen"))
    if isinstance(strategy, str) and strategy.lower() in StrategyRegistry:
        return str(StrategyRegistry[strategy.lower()]["init_params"].get("start_method", "popen"))
    return str(getattr(strategy, "_start_method", "popen"))


def _strategy_name(strategy: Any) -> str:
    if isinstance(strategy, Mapping) and "_target_" in strategy:
        return f"{{_target_: {strategy['_target_']}}}"
    return str(strategy)


def _strategy_class(strategy: Any, processes: int) -> Optional[type]:
    """The Strategy class the configured strategy makes; "auto" on several processes is Lightning's DDP."""
    if isinstance(strategy, Mapping) and isinstance(strategy.get("_target_"), str):
        found = locate_target("trainer.strategy._target_", strategy["_target_"])
        return found if isinstance(found, type) else None
    if strategy in (None, "auto"):
        return DDPStrategy if processes > 1 else None
    if isinstance(strategy, str) and strategy.lower() in StrategyRegistry:
        return StrategyRegistry[strategy.lower()]["strategy"]
    return type(strategy) if not isinstance(strategy, str) else None


class CompressedDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy, whose communication hook is registered on any device: Lightning's own
    registers it on CUDA only, and on CPU processes (gloo) would train uncompressed without a word."""

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":
            super()._register_ddp_hooks()
            return
        assert isinstance(self.model, DistributedDataParallel)
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)


def _is_plain_ddp(cls: type) -> bool:
    """Lightning's DDPStrategy or a subclass that keeps its hooks: DeepSpeed and XLA derive from it
    but do not register DDP communication hooks."""
    return issubclass(cls, DDPStrategy) and not issubclass(cls, (DeepSpeedStrategy, XLAStrategy))


def _backend(strategy: Any, accelerator: str) -> str:
    """The process-group backend: the strategy's ``process_group_backend``, else Lightning's default
    for the device (NCCL for CUDA, gloo otherwise)."""
    if isinstance(strategy, Mapping) and strategy.get("process_group_backend"):
        return str(strategy["process_group_backend"])
    return "nccl" if accelerator == "cuda" else "gloo"


def _check_bf16(backend: str) -> None:
    """gloo all-reduces bfloat16 (checked on torch 2.14's CPU build); NCCL from 2.10 on."""
    if backend == "nccl":
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        if version is None or tuple(version[:2]) < NCCL_BF16:
            found = ".".join(map(str, version)) if version else "none"
            raise UserError("trainer.gradient_compression", f"bf16 needs NCCL >= 2.10 to all-reduce bfloat16, and "
                            f"this torch build has NCCL {found}", "fp16, powersgd or none")
    elif backend != "gloo":
        raise UserError("trainer.gradient_compression", f"bf16 on the '{backend}' backend, which is not known to "
                        "all-reduce bfloat16", "fp16, powersgd or none (or bf16 on nccl or gloo)")


def hook_and_state(communication: Communication) -> tuple[Callable[..., Any], Optional[object]]:
    """torch's hook for the choice, and its state (PowerSGD's; the others keep none). A new state
    for each call: it holds the error feedback and step count of one run."""
    choice = communication.gradient_compression
    halves = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    if choice in halves:
        return halves[choice], None
    if choice == "powersgd":
        # process_group None: the default group, which exists by the time DDP calls the hook.
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=communication.powersgd_rank,
                                            start_powerSGD_iter=communication.powersgd_start_step)
        return powerSGD_hook.powerSGD_hook, state
    raise ValueError(f"no hook for gradient_compression={choice}")


def strategy_target(communication: Communication, strategy: Any) -> dict[str, Any]:
    """The ``trainer.strategy`` argument that makes the compressed DDP strategy: a `_target_`
    mapping (trainer/groups/trainer.py builds those fresh for each Trainer, so no two share a
    PowerSGD state) around the configured strategy."""
    return {"_target_": f"{__name__}.compressed_ddp", "_recursive_": False, "strategy": strategy,
            **{key: getattr(communication, key) for key in KEYS}}


def compressed_ddp(strategy: Any, gradient_compression: Compression, powersgd_rank: int,
                   powersgd_start_step: int) -> "CompressedDDPStrategy":
    """The configured DDP strategy (an alias such as ``ddp_find_unused_parameters_true``, or a
    `_target_` mapping with its arguments) made with the compression's hook and state."""
    hook, state = hook_and_state(Communication(gradient_compression, powersgd_rank, powersgd_start_step))
    if isinstance(strategy, Mapping) and "_target_" in strategy:
        # decide() allowed DDPStrategy itself only: its arguments, given to the subclass.
        arguments = instantiate({**strategy, "_target_": "builtins.dict"}, _convert_="all")
    elif isinstance(strategy, str) and strategy.lower() in StrategyRegistry:
        arguments = dict(StrategyRegistry[strategy.lower()]["init_params"])
    else:  # auto on several processes (decide refused every other kind)
        arguments = {}
    return CompressedDDPStrategy(**arguments, ddp_comm_hook=hook, ddp_comm_state=state)
