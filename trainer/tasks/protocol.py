"""The protocol a task follows, so that the framework can drive any of them the same way: what a
batch is, the loss (fp32), the metrics, the unit a batch is counted in, the training FLOPs per unit,
random batches of the data's shape, and what cannot apply to it. Every practice works on the network
and the optimizer, so it reaches every task through this protocol. docs/tasks.md tables the members;
a team's own task subclasses `TaskDefinition` and is chosen with ``task._target_=pkg.Class``."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Optional

import torch
from torch import nn
from torchmetrics import Metric

from trainer.data.base import DataInfo

#: The units a batch may be counted in.
UNITS = ("samples", "tokens")


class TaskDefinition:
    """The default behaviour of every method is the plain supervised case: a batch is
    ``(inputs, targets)``, the network is called with ``inputs``, a batch holds as many units as
    samples. Subclasses override what differs. Constructor arguments are the task's config keys
    (checked against the signature, as every `_target_` of the framework); `bind` is then told
    what the data say, before anything else is asked."""

    #: What a batch is counted in: "samples" or "tokens".
    unit: ClassVar[str] = "samples"
    #: What the throughput meter reports beside samples/s and takes MFU per (None: `unit`), counted by
    #: `rate_units_in` (a sequence classifier's batches count in sequences, its rate in tokens).
    rate_unit: ClassVar[Optional[str]] = None
    #: The data kinds (DataInfo.kind) the task can learn from.
    data_kinds: ClassVar[tuple[str, ...]] = ("images", "features", "tokens")
    #: Constructor arguments the network must take that the data fill in (checked before building).
    model_inputs: ClassVar[tuple[str, ...]] = ()
    #: What train.py returns to a sweeper with objective=auto (split/metric).
    objective: ClassVar[str] = "val/loss"
    #: The `regularization` group's practices the task takes: "label_smoothing" (its loss smooths the
    #: targets), "mixing" (mixup and cutmix of its batches). Any other configured is refused.
    regularization: ClassVar[tuple[str, ...]] = ()

    def bind(self, info: DataInfo) -> None:
        """Told what the data say (classes, vocabulary, shapes) before anything else is asked."""
        self.info = info

    # -- a batch -----------------------------------------------------------------------------------
    def inputs(self, batch: Any) -> Any:
        """What the network is called with."""
        return batch[0]

    def targets(self, batch: Any) -> Any:
        return batch[1]

    def units_in(self, batch: Any) -> int | torch.Tensor:
        """How many units this batch holds (this process's share). A tensor is allowed: the
        throughput meter adds them up on the device and reads the sum once per window."""
        return int(self.targets(batch).shape[0])

    def rate_units_in(self, batch: Any) -> int | torch.Tensor:
        """How many `rate_unit`s this batch holds (its `units_in` when the task has no rate unit of its own)."""
        return self.units_in(batch)

    def units_per_sample(self) -> int:
        """Units in one sample as the loader ships it (tokens of a packed sequence): the per-device
        batch in samples times this is the batch in the task's unit."""
        return 1

    # -- the step ----------------------------------------------------------------------------------
    def forward(self, net: nn.Module, batch: Any) -> Any:
        """The network's outputs for a batch (`net` is the LightningModule: calling it applies the
        plan's memory format before the network)."""
        return net(self.inputs(batch))

    def training_batch(self, batch: Any) -> Any:
        """The batch a training step learns from (mixup and cutmix change it); unchanged by default."""
        return batch

    def use_regularization(self, label_smoothing: float, mixing: Any) -> None:
        """The `regularization` group's settings, for a task that names them in `regularization`:
        `mixing` is a callable (inputs, targets) -> (inputs, targets) or None."""

    def loss(self, outputs: Any, targets: Any, training: bool) -> torch.Tensor:
        """The loss of a batch (a scalar, fp32). `training`: the training loss (label smoothing and
        the like apply); the evaluation loss is the plain one, comparable between runs."""
        raise NotImplementedError(f"{type(self).__name__} must define loss()")

    def check_outputs(self, outputs: Any, targets: Any) -> str | None:
        """What is wrong with a batch's outputs for these targets, in words (None: nothing), e.g. a head of
        the wrong width: asked once, on the first batch before training (trainer/phases/first_batch.py),
        which checks the loss, the metrics and their shapes anyway."""
        return None

    def metrics(self, split: str) -> Mapping[str, Metric]:
        """The metrics logged as ``{split}/{name}`` beside ``{split}/loss`` ("train", "val", "test"),
        new objects on each call. Epoch-level: updated every step, computed at the epoch's end."""
        return {}

    def update_metrics(self, metrics: Mapping[str, Metric], outputs: Any, targets: Any) -> None:
        """Update `metrics` (what `metrics(split)` made) with a batch's outputs and targets."""
        for metric in metrics.values():
            metric.update(outputs, targets)

    def metrics_from_loss(self) -> Mapping[str, Metric]:
        """Metrics of the loss's epoch mean (a language model's perplexity), logged for validation and
        test as ``{split}/{name}``; each is updated with the batch's loss and its units as the weight."""
        return {}

    # -- what the framework measures with ----------------------------------------------------------
    def example_batch(self, size: int, device: torch.device) -> tuple[Any, Any]:
        """Random (inputs, targets) of `size` samples of the data's shape on `device`: what the
        memory plan and the batch finder step with (``loss(net(inputs), targets, True)``)."""
        raise NotImplementedError(f"{type(self).__name__} must define example_batch()")

    def flops_per_unit(self, net: nn.Module) -> tuple[int | None, str]:
        """Training FLOPs (forward and backward) per unit and how they were counted, for MFU. (None, ""): torch's
        FLOP counter counts them on a meta-device copy at the data's input shape, divided by `units_per_sample`
        (trainer/measure/mfu.py). A task with a closed form (a Transformer's 6N plus attention) returns it;
        (None, why) leaves MFU out."""
        return None, ""

    def refusals(self, settings: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        """What cannot apply to this task beyond what `data_kinds` and `regularization` say:
        (key, what is wrong, what is allowed) for each. `settings`: the choices and a few resolved
        values the rules read (``data.sequences``, ``compile.dynamic``, ...)."""
        return []

    def describe(self) -> str:
        """One line for the plan."""
        return f"{type(self).__name__}: batches counted in {self.unit}"

    def hyperparameters(self) -> dict[str, Any]:
        """Plain values saved with the checkpoint's hyper-parameters."""
        return {"task": type(self).__name__, "unit": self.unit}
