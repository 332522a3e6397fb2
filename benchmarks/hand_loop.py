"""The project's own hand-written training loop, and the framework's loop beside it, built from one
composed config: what "no overhead" looks like for a run, to time the framework against.

    from hand_loop import prepare_hand_loop, time_windows
    loop = prepare_hand_loop(["model=resnet50", "data=synthetic", ...], run_dir)
    seconds = time_windows(loop, steps=36, warmup=5, window=10, device=loop.device)   # 3 windows
    loop.facts()   # what it ran: lr and weight decay per group, kernel, precision, memory format, ...

`prepare_run` composes the overrides as `train.py` does and goes through the run's own phases
(trainer/run.py) up to the built task: validation, the devices, the data module, the network and the
task definition (`build_parts`), the batch finder and lr finder where asked, the plan (`resolve`), and
the plan applied (`build_task`: activation checkpointing, TF32, compile, channels_last). So the
network, its compiled graph, the batch, the optimizer recipe (`plan.optimizer`), the precision and
the kernels are the framework's, by construction.

`HandLoop` is then the plain loop over them, nanoGPT-style: the data module's own loader and its
own move to the device (`transfer_batch_to_device`, then `finish_batch`: the synthetic data make
their batch on the device there, the image modules decode or normalize there), forward and the task
definition's loss under the plan's autocast, `zero_grad(set_to_none=True)`, backward (through a
GradScaler for fp16), `optimizer.step()`, `scheduler.step()`. No metrics, logging, clipping,
non-finite guard or callbacks: what the framework adds is exactly what the ratio prices.
`FrameworkLoop` runs the same `Run` through the framework's Trainer (`build_trainer`: every callback,
logger and setting a run has, validation off) for a number of steps. Both have
`run(steps, on_step_start)`; each call is one pass from the loader's first batch with a fresh
optimizer and a schedule over `steps`, as one fit is. Built from one `Run`, the two share the
network object, so a compiled network is compiled once and both run the same kernels.

`time_windows` times either the same way: the device synchronized and the clock read at the start
of step `warmup`, then every `window` steps; `steps = warmup + n * window + 1` gives n windows, none
of which holds the loop's start or end.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parent.parent

StepHook = Callable[[int], None]

#: Lightning's precision strings the hand loop reproduces, with their autocast dtype.
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def compose_run_config(overrides: Sequence[str]) -> tuple[Any, dict[str, str]]:
    """The config `train.py` composes from `overrides`, and its group choices (as Hydra records them)."""
    from hydra import compose, initialize_config_dir

    from trainer.configuration.hydra_setup import install as install_hydra_setup

    install_hydra_setup()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra") and v is not None}
    return cfg, choices


def prepare_run(overrides: Sequence[str], run_dir: Path, compile_mode: Optional[str] = None) -> Any:
    """A `trainer.phases.state.Run` as trainer/run.py has it just before it builds the Trainer (the plan
    applied, `run.task` made). `compile_mode`: a torch.compile mode applied instead of the plan's,
    also one the `compile` group does not offer (the ceiling search's max-autotune-no-cudagraphs)."""
    import lightning as L

    from trainer.callbacks.graceful import SignalLatch
    from trainer.phases.build import build_parts, build_task
    from trainer.phases.compose import Job
    from trainer.phases.identify import check_job, identify
    from trainer.phases.state import Run
    from trainer.run import plan_run

    cfg, choices = compose_run_config(overrides)
    run = Run(Job(cfg, Path(run_dir), choices, list(overrides)), SignalLatch())
    check_job(run)
    if run.devices.processes > 1 or int(run.spec.trainer.get("accumulate_grad_batches", 1)) != 1:
        raise ValueError("the hand loop runs one process without gradient accumulation: give trainer.devices=1 "
                         "and trainer.accumulate_grad_batches=1")
    identify(run)
    L.seed_everything(run.spec.top.seed, workers=True, verbose=False)
    build_parts(run)
    plan_run(run)
    if compile_mode is not None:
        run.plan = dataclasses.replace(run.plan, compile_mode=compile_mode)
    build_task(run)
    torch.backends.cudnn.benchmark = run.plan.cudnn_benchmark  # the Trainer's `benchmark` argument
    return run


def prepare_hand_loop(overrides: Sequence[str], run_dir: Path, compile_mode: Optional[str] = None) -> HandLoop:
    """The hand loop over the run `train.py` would make from `overrides` (see `prepare_run`)."""
    return HandLoop(prepare_run(overrides, run_dir, compile_mode))


def _optimizer_facts(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from trainer.infra.summary import optimizer_param_groups

    groups = optimizer_param_groups([optimizer])
    kernel = ("fused" if any(g["fused"] for g in groups) else "foreach" if any(g["foreach"] for g in groups)
              else "for_loop")
    return {"optimizer": type(optimizer).__name__, "kernel": kernel, "param_groups": groups}


def _memory_format(net: torch.nn.Module) -> str:
    """channels_last or contiguous, by the first convolution weight wider than 1x1 (a 1x1 kernel's
    strides read the same in both formats); n/a without one."""
    weight = next((p for p in net.parameters() if p.ndim == 4 and p.shape[-1] * p.shape[-2] > 1), None)
    if weight is None:
        return "n/a"
    return "channels_last" if weight.is_contiguous(memory_format=torch.channels_last) and \
        not weight.is_contiguous() else "contiguous"


class _Loops:
    """What the hand loop and the framework's loop share: the built run and the facts of it."""

    def __init__(self, run: Any) -> None:
        self.run_state = run
        self.plan = run.plan
        self.net: torch.nn.Module = run.task.net
        self.datamodule = run.parts.datamodule
        self.definition = run.parts.definition
        self.device = self.plan.device
        self.compile_mode: str = self.plan.compile_mode
        self.optimizer: Optional[torch.optim.Optimizer] = None

    @property
    def units_per_step(self) -> int:
        """The task's units (samples, tokens) one step learns from: the batch times the units a sample holds."""
        return self.plan.batch_size * self.plan.units_per_sample

    def facts(self) -> dict[str, Any]:
        """What this loop ran (or will run): the optimizer's groups and kernel as built, the precision,
        the memory format, compile, the network's size, torch's threads, the batch and the device."""
        optimizer = self.optimizer or self.plan.optimizer.build(self.net)
        plan = self.plan
        return {"device": str(self.device), "precision": self.precision, "memory_format": _memory_format(self.net),
                "compile_mode": self.compile_mode,
                "compiled": getattr(self.net, "_compiled_call_impl", None) is not None,
                "tf32": plan.tf32, "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                "parameters": sum(p.numel() for p in self.net.parameters()), "torch_threads": torch.get_num_threads(),
                "batch_size": plan.batch_size, "unit": plan.unit, "units_per_step": self.units_per_step,
                "flops_per_unit": plan.flops_per_sample, "scheduler": self.run_state.spec.scheduler.name,
                **_optimizer_facts(optimizer)}

    @property
    def precision(self) -> str:
        return self.plan.precision


class HandLoop(_Loops):
    """The plain loop (module docstring); `run_state` is the framework's `Run` it was built from."""

    def __init__(self, run: Any) -> None:
        super().__init__(run)
        if self.precision not in AUTOCAST:
            raise ValueError(f"the hand loop has no precision '{self.precision}'; it has {', '.join(AUTOCAST)}")
        self.datamodule.setup("fit")
        self.loader = self.datamodule.train_dataloader()
        self.scheduler_cfg = run.spec.scheduler
        #: The last step's loss (a device tensor, never read by the loop: reading it would sync).
        self.last_loss: Optional[torch.Tensor] = None
        self.steps_done = 0

    def run(self, steps: int, on_step_start: Optional[StepHook] = None) -> None:
        """`steps` training steps from the loader's first batch, with a fresh optimizer (the plan's
        recipe) and the configured schedule over `steps`, as one fit; `on_step_start(i)` before step
        i fetches its batch."""
        from trainer.groups.scheduler import build_scheduler

        net, definition = self.net, self.definition
        # On the device every run: a fit of the framework's loop over the same network ends with
        # Lightning's teardown, which moves it to the CPU.
        net.to(self.device)
        optimizer = self.optimizer = self.plan.optimizer.build(net)
        schedule = build_scheduler(optimizer, self.scheduler_cfg, steps)
        scheduler, per_step = schedule["scheduler"], schedule["interval"] == "step"
        dtype = AUTOCAST[self.precision]
        scaler = torch.amp.GradScaler(self.device.type) if dtype == torch.float16 else None
        mark_cudagraph_step = "reduce-overhead" in self.compile_mode
        batches = self._batches(scheduler if not per_step else None)
        net.train()
        for index in range(steps):
            if on_step_start is not None:
                on_step_start(index)
            batch = definition.training_batch(next(batches))
            if mark_cudagraph_step:  # CUDA graphs replay into the last step's outputs: say a new step began
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                outputs = definition.forward(self._forward, batch)
                loss = definition.loss(outputs, definition.targets(batch), training=True)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            if per_step:
                scheduler.step()
            self.last_loss = loss.detach()
            self.steps_done += 1

    def _forward(self, inputs: Any) -> Any:
        """The network on a batch's inputs, in the plan's memory format (as TrainingTask.forward)."""
        if self.plan.channels_last and isinstance(inputs, torch.Tensor) and inputs.ndim == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return self.net(inputs)

    def _batches(self, epoch_scheduler: Any) -> Iterator[Any]:
        """Training batches on the device as the step receives them, epoch after epoch from the first."""
        epoch = 0
        while True:
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for batch in self.loader:
                moved = self.datamodule.transfer_batch_to_device(batch, self.device, 0)
                yield self.datamodule.finish_batch(moved, training=True)
            if epoch_scheduler is not None:
                epoch_scheduler.step()
            epoch += 1


class _OnStepStart(Callback):
    def __init__(self, hook: StepHook) -> None:
        self.hook = hook
        self.index = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.hook(self.index)
        self.index += 1


class FrameworkLoop(_Loops):
    """The framework's own loop over a built `Run`: each `run(steps)` is one fit of `steps` steps by a
    Trainer as `build_trainer` makes it for the run (its callbacks, loggers and settings), validation
    and the sanity check off. `meter_warmup`: the throughput meter's warm-up steps instead of its
    default (a measurement whose windows must start later, after a loader's queue drains)."""

    def __init__(self, run: Any, meter_warmup: Optional[int] = None) -> None:
        super().__init__(run)
        self.meter_warmup = meter_warmup
        #: The last fit's Trainer and its callbacks' records (the meter's windows, the utilisation).
        self.trainer: Any = None
        self.meter: Any = None

    def run(self, steps: int, on_step_start: Optional[StepHook] = None) -> None:
        from trainer.infra.library_logs import quiet_library_warnings
        from trainer.phases.build import build_trainer

        run = self.run_state
        spec = run.spec
        trainer_args = {key: value for key, value in spec.trainer.items() if key != "val_check_interval"}
        run.spec = dataclasses.replace(spec, trainer={**trainer_args, "max_steps": steps, "max_epochs": -1,
                                                      "limit_train_batches": None, "limit_val_batches": 0,
                                                      "num_sanity_val_steps": 0})
        try:
            hooks = [_OnStepStart(on_step_start)] if on_step_start is not None else []
            built = build_trainer(run, extra_callbacks=hooks)
        finally:
            run.spec = spec
        if self.meter_warmup is not None:
            built.meter.warmup_steps = built.meter._warmup_left = self.meter_warmup
        self.trainer, self.meter = built.trainer, built.meter
        with quiet_library_warnings():
            built.trainer.fit(run.task, datamodule=self.datamodule)
        self.optimizer = built.trainer.optimizers[0]

    @property
    def precision(self) -> str:
        return str(self.trainer.precision) if self.trainer is not None else self.plan.precision


def compare_facts(first: dict[str, Any], second: dict[str, Any], names: tuple[str, str] = ("hand", "framework"),
                  ignore: Sequence[str] = ()) -> list[str]:
    """Where two loops' facts differ ("key: A vs B"); empty when they ran the same work."""
    problems = []
    for key in sorted(set(first) | set(second)):
        if key in ignore or first.get(key) == second.get(key):
            continue
        problems.append(f"{key}: {names[0]} {first.get(key)} vs {names[1]} {second.get(key)}")
    return problems


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (the throughput meter's own, so both sides wait alike)."""
    from trainer.callbacks.throughput import synchronize as meter_synchronize

    meter_synchronize(device)


def steps_for(windows: int, warmup: int, window: int) -> int:
    """The steps `time_windows` needs for `windows` full windows."""
    return warmup + windows * window + 1


def time_windows(loop: Any, steps: int, warmup: int, window: int, device: torch.device) -> list[float]:
    """Run `loop.run(steps, ...)` and return the seconds of each timed window: the device synchronized
    and the clock read at the start of step `warmup` and of every `window`-th step after it that
    starts; (steps - warmup - 1) // window windows (`steps_for`). The data wait is inside a window."""
    if steps < steps_for(1, warmup, window):
        raise ValueError(f"{steps} steps hold no full window after {warmup} warm-up steps: give at least "
                         f"{steps_for(1, warmup, window)}")
    marks: list[float] = []

    def mark(index: int) -> None:
        if index >= warmup and (index - warmup) % window == 0:
            synchronize(device)
            marks.append(time.perf_counter())

    loop.run(steps, on_step_start=mark)
    return [end - start for start, end in zip(marks, marks[1:])]



def add_window_arguments(parser: Any, measured: str) -> None:
    """`--warmup`, `--window` and `--windows` as `time_windows` takes them (`window_defaults` fills
    what is not given); `measured`: what one measurement is called in the help (a run, a setting)."""
    parser.add_argument("--warmup", type=int, help="warm-up steps before the first window (default 5; --quick 2)")
    parser.add_argument("--window", type=int, help="steps a window (default 10; --quick 3)")
    parser.add_argument("--windows", type=int, help=f"timed windows {measured} (default 3; --quick 2)")


def add_output_arguments(parser: Any, figures: str, runs_dir_default: str = "a temporary folder") -> None:
    """`--runs-dir`, `--out` (the Markdown table) and `--json` (`figures`: what the record holds), as
    `write_results` takes them."""
    parser.add_argument("--runs-dir", type=Path, help=f"the runs' folders (default: {runs_dir_default})")
    parser.add_argument("--out", type=Path, help="the Markdown table")
    parser.add_argument("--json", type=Path, help=figures)


def window_defaults(args: Any, quick: bool) -> None:
    """The window settings not given on the command line: short ones for a --quick dry run."""
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 5)
    args.window = args.window or (3 if quick else 10)
    args.windows = args.windows or (2 if quick else 3)


def write_results(out: Optional[Path], table: str, json_out: Optional[Path], record: Any) -> None:
    """The Markdown table to `out` and the record to `json_out`, each where given (folders made):
    rewritten after every row, so a stopped benchmark leaves what it measured."""
    import json

    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=2, default=str) + "\n")
