"""Derived values: each concrete setting the run will use, with how it was derived.

Printed at start and stored in summary.json, so "why did it pick 0 workers?" is never a mystery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.config import RunSpec
from trainer.data.base import ImageClassificationData
from trainer.data.loader import LoaderSettings
from trainer.errors import UserError
from trainer.optimizer import choose_implementation
from trainer.devices import count_devices, resolve_accelerator
from trainer.precision import resolve_precision, resolve_tf32
from trainer.scaling import scale


@dataclass(frozen=True)
class Derived:
    value: Any
    how: str


@dataclass
class Plan:
    accelerator: str
    devices: int
    precision: str
    loader: LoaderSettings
    global_batch_size: int
    lr: float
    weight_decay: float
    derived: dict[str, Derived] = field(default_factory=dict)
    optimizer_implementation: str = "foreach"
    tf32: bool = False

    def lines(self) -> list[str]:
        width = max(len(k) for k in self.derived)
        return [f"{key:<{width}}  {d.value!s:<12} {d.how}" for key, d in self.derived.items()]

    def to_dict(self) -> dict[str, Any]:
        return {key: {"value": d.value, "how": d.how} for key, d in self.derived.items()}


def resolve(spec: RunSpec, datamodule: ImageClassificationData, sample_bytes: int = 0) -> Plan:
    """`datamodule` resolves its own loader settings for the chosen device; `sample_bytes`, one
    sample as its loader ships it, bounds the prefetch depth."""
    derived: dict[str, Derived] = {}
    accelerator, how = resolve_accelerator(str(spec.trainer.get("accelerator", "auto")))
    derived["trainer.accelerator"] = Derived(accelerator, how)

    devices = count_devices(spec.trainer.get("devices", 1), accelerator)
    if devices < 1:
        raise UserError("trainer.devices", f"resolves to {devices} devices", "a positive count, a list of ids, or auto")
    nodes = int(spec.trainer.get("num_nodes", 1))
    accumulation = int(spec.trainer.get("accumulate_grad_batches", 1))
    batch = int(spec.data["batch_size"])
    global_batch = batch * devices * nodes * accumulation
    derived["global_batch_size"] = Derived(
        global_batch, f"{batch} per device x {devices} devices x {nodes} nodes x {accumulation} accumulation")

    precision, how = resolve_precision(spec.precision.name, accelerator)
    derived["precision"] = Derived(precision, how)

    loader = datamodule.configure_loader(cuda=accelerator == "cuda", batch_bytes=sample_bytes * batch or None)
    for key, reason in loader.reasons.items():
        derived[f"data.{key}"] = Derived(getattr(loader, key), reason)

    opt = spec.optimizer
    lr = scale("lr", opt.lr, opt.lr_scaling, global_batch, opt.ref_batch_size)
    wd = scale("weight_decay", opt.weight_decay, opt.wd_scaling, global_batch, opt.ref_batch_size)
    derived["optimizer.lr"] = Derived(round(lr.value, 10), lr.how)
    derived["optimizer.weight_decay"] = Derived(round(wd.value, 10), wd.how)
    derived["optimizer.decay_norm_and_bias"] = Derived(
        opt.decay_norm_and_bias, "weight decay on every parameter" if opt.decay_norm_and_bias
        else "no weight decay on 1-D parameters (norm weights, biases)")
    implementation, how = choose_implementation(opt.implementation, accelerator, grad_scaler=precision == "16-mixed")
    derived["optimizer.implementation"] = Derived(implementation, how)

    deterministic = bool(spec.trainer.get("deterministic", False))
    tf32, how = resolve_tf32(spec.precision.tf32, accelerator, deterministic)
    derived["precision.tf32"] = Derived(tf32, how)
    return Plan(accelerator, devices, precision, loader, global_batch, lr.value, wd.value, derived,
                implementation, tf32)
