"""Metrics the tasks share: the mean of a per-batch value weighted by what each batch holds (its
samples or tokens), perplexity as exp of that mean, and the accuracy a training step can afford;
the two a training step updates take `StepUpdate.add_step`, torchmetrics' update without its wrapper.

Deliberately not torchmetrics' `MeanMetric`: with ``nan_strategy="disable"`` (the setting that saves
a host sync per update) torchmetrics 1.9 replaces the weights with ones (its issue #3434), so a short
last batch or bucketed sequences would count as much as a full batch; and its NaN check is a sync
per update. Two sums, reduced over processes at the epoch's end, need neither."""

from __future__ import annotations

from typing import Any, cast

import torch
from torchmetrics import Metric


class StepUpdate:
    """`add_step`: a metric's `update` for every training step, without torchmetrics' wrapper around
    it (which resets the cache, counts the update and switches autograd off through three attribute
    sets and a context manager: about 10 us of host time a call here). The same bookkeeping, done
    directly; the update itself must detach what it is given.

    A count the host already knows (the samples of a batch, a weight of 1) is not added on the device
    every step (an operation, as much host time as the update's other work): `count_on_host` keeps it
    in a Python number, added into the state named `HOST_COUNTED` before the states are read or
    combined (a sync, `compute`, `forward`, `merge_state`, `metric_state`: what a checkpoint saves)
    and dropped by `reset`."""

    HOST_COUNTED: str = ""

    def add_step(self, *args: Any) -> None:
        state = self.__dict__
        state["_computed"] = None
        state["_update_count"] += 1
        cast(Any, type(self)).update(self, *args)  # the class's own update: torchmetrics wraps the instance's

    def count_on_host(self, amount: float) -> None:
        self.__dict__["_host_count"] = self.__dict__.get("_host_count", 0) + amount

    def fold_host_count(self) -> None:
        """The count kept on the host, into its state (one operation, at a read)."""
        amount = self.__dict__.pop("_host_count", 0)
        if amount:
            getattr(self, self.HOST_COUNTED).add_(amount)

    def sync(self, *args: Any, **kwargs: Any) -> None:
        self.fold_host_count()
        super().sync(*args, **kwargs)  # type: ignore[misc]  # Metric's, next in the method order

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.fold_host_count()  # before torchmetrics takes the states aside and resets
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def merge_state(self, incoming_state: Any) -> None:
        self.fold_host_count()
        if isinstance(incoming_state, StepUpdate):
            incoming_state.fold_host_count()
        super().merge_state(incoming_state)  # type: ignore[misc]

    @property
    def metric_state(self) -> dict[str, Any]:
        self.fold_host_count()
        return super().metric_state  # type: ignore[misc]

    def reset(self) -> None:
        self.__dict__.pop("_host_count", None)
        super().reset()  # type: ignore[misc]


class WeightedMean(StepUpdate, Metric):
    """sum(value x weight) / sum(weight), synchronized over processes like any torchmetrics sum."""

    full_state_update = False
    HOST_COUNTED = "weight"
    total: torch.Tensor
    weight: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        # In place: the training loss's mean is updated every step, where every operation is host time.
        value = value.detach()
        if isinstance(weight, (int, float)):
            self.total.add_(value, alpha=weight)
            self.count_on_host(weight)
            return
        weight = weight.to(device=self.total.device, dtype=torch.float64)
        self.total.add_(value * weight)
        self.weight.add_(weight)

    def compute(self) -> torch.Tensor:
        self.fold_host_count()
        return (self.total / self.weight).to(torch.float32)

    def keep_batch_value(self, value: torch.Tensor) -> None:
        """Keep `value`, already updated, as the batch's own value (what `forward` returns and
        Lightning logs as the step's): one batch's weighted mean is its value. Without forward's
        copy, reset and merge of the states."""
        self._forward_cache = value.detach().to(torch.float32)  # type: ignore[assignment]  # torchmetrics types it None


class Perplexity(WeightedMean):
    """exp of the mean loss per token, weighted by the tokens of each batch (not a mean of
    per-batch perplexities)."""

    higher_is_better = False

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


class Accuracy(StepUpdate, Metric):
    """The share of samples whose largest output is their label: micro top-1 accuracy, the value
    torchmetrics' `MulticlassAccuracy(average="micro")` computes, in the few operations a training
    step can afford (argmax, compare, sum, two in-place adds; about 10x less host time than
    torchmetrics' argument checks and stat-score bookkeeping)."""

    full_state_update = False
    higher_is_better = True
    HOST_COUNTED = "total"
    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, outputs: torch.Tensor, labels: torch.Tensor) -> None:
        # (argmax's result has no gradient: nothing for autograd to record)
        self.correct.add_((outputs.argmax(dim=-1) == labels).sum())
        self.count_on_host(labels.numel())

    def compute(self) -> torch.Tensor:
        self.fold_host_count()
        return self.correct.float() / self.total
