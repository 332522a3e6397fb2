"""The first-batch check: before anything trains or measures, one small training batch goes from
the data module through the network and the task on the run's device (forward, loss, backward and
the metrics' update; no optimizer step), on a copy of the network and with the random generators
put back, so the run itself is unchanged. A mismatch between the parts (inputs of another dtype or
shape than the network was built for, a head of another width than the classes, a loss that fails
or is not one number, metrics that refuse the outputs) is one line naming the part and the shapes,
instead of a traceback from inside the first step (or from a measurement before it)."""

from __future__ import annotations

import copy
import warnings
from functools import partial
from typing import Any

import torch
from torch import nn

from trainer.data.base import DataInfo, DataModule
from trainer.data.loader import LoaderSettings
from trainer.infra.errors import UserError, exception_line
from trainer.tasks.protocol import TaskDefinition

#: Samples in the checked batch (two: BatchNorm needs more than one value per channel).
CHECK_SAMPLES = 2
_ONE_PROCESS = LoaderSettings(num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None,
                              reasons={})


def describe(value: Any) -> str:
    """A batch's part as the line shows it: ``2 x 10 float32`` for a tensor, each part of a tuple."""
    if isinstance(value, torch.Tensor):
        shape = " x ".join(str(n) for n in value.shape) or "scalar"
        return f"{shape} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def check_first_batch(datamodule: DataModule, info: DataInfo, net: nn.Module,
                      definition: TaskDefinition, device: torch.device) -> None:
    """One batch through the data module, the network and the task on `device`: a `UserError` for
    the first part that does not fit the others."""
    batch = take_batch(datamodule, device)
    inputs = _call("task", definition, "inputs", lambda: definition.inputs(batch))
    _check_inputs(type(datamodule).__name__, inputs, info, net)
    model = copy.deepcopy(net).to(device).train()  # the run's network, statistics and gradients stay as built
    forks = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forks):
        batch = _call("task", definition, "training_batch", lambda: definition.training_batch(batch))
        outputs = _call("model", model, "forward", lambda: definition.forward(model, batch),
                        f" on inputs {describe(definition.inputs(batch))}")
        targets = _call("task", definition, "targets", lambda: definition.targets(batch))
        shapes = f" on outputs {describe(outputs)} and targets {describe(targets)}"
        wrong = definition.check_outputs(outputs, targets)
        if wrong:
            raise UserError("model", f"{type(net).__name__}: {wrong}")
        loss = _loss(definition, outputs, targets, shapes)
        _call("task", definition, "loss", loss.backward, f" (its backward){shapes}")
    detached = outputs.detach() if isinstance(outputs, torch.Tensor) else outputs
    for split in ("train", "val"):
        metrics = {name: metric.to(device) for name, metric in definition.metrics(split).items()}
        with torch.no_grad():
            _call("task", definition, "update_metrics", partial(definition.update_metrics, metrics, detached, targets),
                  f" for {split}'s metrics{shapes}")


#: What an empty training loader's first batch is.
_NO_BATCH = object()


def take_batch(datamodule: DataModule, device: torch.device) -> Any:
    """The first training batch of `CHECK_SAMPLES` samples as a step receives it, read in this
    process (no loader workers), through Lightning's hooks of the data module; the module is left
    as it was (batch size, loader settings, splits not set up), so the run sets it up as planned."""
    kept = dict(vars(datamodule))  # every attribute, put back after (the splits, the decode mode, the sampler)
    name = type(datamodule).__name__
    datamodule.set_batch_size(min(CHECK_SAMPLES, datamodule.batch_size))
    datamodule.apply_loader(_ONE_PROCESS)
    try:
        _call("data", datamodule, "setup", lambda: datamodule.setup("fit"))
        loader = _call("data", datamodule, "train_dataloader", datamodule.train_dataloader)
        # next() with a default: a StopIteration raised inside _call would read as the loader failing.
        batch = _call("data", datamodule, "train_dataloader", lambda: next(iter(loader), _NO_BATCH),
                      " (its first batch)")
        if batch is _NO_BATCH:
            raise UserError("data", f"{name}.train_dataloader() gives no batch",
                            "a training split of at least one batch")
        batch = datamodule.on_before_batch_transfer(batch, 0)
        batch = datamodule.transfer_batch_to_device(batch, device, 0)
        return _call("data", datamodule, "on_after_batch_transfer", lambda: datamodule.on_after_batch_transfer(batch, 0))
    finally:
        vars(datamodule).clear()
        vars(datamodule).update(kept)


def _check_inputs(data: str, inputs: Any, info: DataInfo, net: nn.Module) -> None:
    """Floating inputs of the weights' dtype; a table's rows as wide as the network was built for,
    an image's channels as many."""
    if not isinstance(inputs, torch.Tensor):
        return
    weights = next((p.dtype for p in net.parameters() if p.is_floating_point()), None)
    if inputs.is_floating_point() and weights is not None and inputs.dtype != weights:
        raise UserError("data", f"{data} gives inputs {describe(inputs)} to a network of "
                        f"{str(weights).removeprefix('torch.')} weights",
                        f"{str(weights).removeprefix('torch.')} inputs (convert them in the data module)")
    sample, expected = tuple(inputs.shape[1:]), info.input_shape()
    if info.kind == "features" and sample != expected or info.kind == "images" and sample[:1] != expected[:1]:
        raise UserError("data", f"{data} gives inputs {describe(inputs)}, but its inspect() says a sample is "
                        f"{' x '.join(map(str, expected))} (what the network was built for)",
                        f"inputs of N x {' x '.join(map(str, expected))}, or a DataInfo that says what setup() gives")


def _loss(definition: TaskDefinition, outputs: Any, targets: Any, shapes: str) -> torch.Tensor:
    """The training loss: one number, connected to the outputs; a loss that only works by
    broadcasting targets of another shape over the outputs (torch warns, and learns the wrong thing)
    is refused too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _call("task", definition, "loss", lambda: definition.loss(outputs, targets, True), shapes)
    name = f"{type(definition).__name__}.loss()"
    broadcast = [str(w.message) for w in caught if "broadcast" in str(w.message)]
    if broadcast:
        raise UserError("task", f"{name}{shapes}: {broadcast[0]}", "targets of the shape the loss compares the "
                        "outputs with")
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        raise UserError("task", f"{name} returns {describe(loss)}{shapes}", "one number: a 0-dim floating tensor "
                        "(the batch's mean loss)")
    if not loss.requires_grad:
        raise UserError("task", f"{name} does not depend on the network's outputs (it has no gradient){shapes}",
                        "a loss computed from the outputs")
    return loss


def _call(part: str, owner: Any, method: str, call: Any, context: str = "") -> Any:
    """`call()`, with its failure as one line naming the part (`data`, `model`, `task`), the class
    and method that failed and the shapes it was given. A `UserError` passes as it is."""
    try:
        return call()
    except UserError:
        raise
    except Exception as ex:  # noqa: BLE001 - the team's code's failure, as one line (HYDRA_FULL_ERROR=1: all)
        raise UserError(part, f"{type(owner).__name__}.{method}() failed{context}: {exception_line(ex, 300)}") from ex
