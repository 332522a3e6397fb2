"""Which dimensions of a model keep tensor cores from running at full speed.

NVIDIA tensor cores run half-precision GEMMs (and the implicit GEMMs behind convolutions) fastest
when the dimensions are multiples of 8 elements (16 bytes); otherwise cuBLAS/cuDNN pad internally
or fall back to slower kernels. What matters here: the batch size, channel counts per group and
feature counts. The report is advice, not an error; sizes set by the data (the first layer's input
channels, the number of classes) are listed apart, as nothing to change in the model config."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

log = logging.getLogger("trainer")

BATCH = "batch"


@dataclass(frozen=True)
class Misalignment:
    """One dimension that is not a multiple of the alignment.

    `where`: the module's dotted name (``features.0.0``) or ``batch``; `what`: the attribute
    (``out_channels``, ``batch_size``, ...); `suggestion`: the next size up that aligns (grouped
    convolutions: every group aligns); `layer`: the module's class; `fixed_by_data`: a size the data
    decide (image channels, number of classes)."""

    where: str
    what: str
    value: int
    suggestion: int
    note: str
    layer: str = ""
    fixed_by_data: bool = False


def alignment_report(model: nn.Module, batch_size: int, multiple: int = 8) -> list[Misalignment]:
    """Every misaligned dimension: the per-device batch size first, then layers in module order,
    then the sizes fixed by the data (first layer's input, last layer's output).

    Layers are `nn.Linear` and convolutions (`Conv1d/2d/3d` and transposed). "First" and "last"
    mean registration order, which matches the forward order for the usual sequential models."""
    if multiple < 1:
        raise ValueError(f"multiple must be at least 1, got {multiple}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")

    items: list[Misalignment] = []
    if batch_size % multiple:
        items.append(Misalignment(
            BATCH, "batch_size", batch_size, _round_up(batch_size, multiple),
            "per device; matters most for linear layers, where the batch is a GEMM dimension"))

    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))]
    fixed: list[Misalignment] = []
    for index, (name, module) in enumerate(layers):
        first, last = index == 0, index == len(layers) - 1
        for item in _layer_items(name, module, multiple, first, last):
            (fixed if item.fixed_by_data else items).append(item)
    return items + fixed


def format_report(items: list[Misalignment], limit: int = 10) -> list[str]:
    """One human line per item, e.g. ``features.0.0 (Conv2d) out_channels 30 -> 32``; after
    `limit` lines, one line counting the rest."""
    lines: list[str] = []
    for item in items[:limit]:
        if item.where == BATCH:
            text = f"per-device batch size {item.value} -> {item.suggestion}"
        else:
            layer = f" ({item.layer})" if item.layer else ""
            text = f"{item.where}{layer} {item.what} {item.value} -> {item.suggestion}"
        if item.note:
            text += f" ({item.note})"
        lines.append(text)
    if len(items) > limit:
        lines.append(f"... and {len(items) - limit} more")
    return lines


def check_alignment(model: nn.Module, batch_size: int, accelerator: str) -> list[str]:
    """The whole report as lines (recorded everywhere); on CUDA the misalignments the person can fix
    are also logged as warnings."""
    items = alignment_report(model, batch_size)
    fixable = [item for item in items if not item.fixed_by_data]
    if report_applies(accelerator) and fixable:
        log.warning("dimensions not multiples of 8 (tensor cores run them padded):")
        for line in format_report(fixable, limit=10):
            log.warning("  %s", line)
    return format_report(items, limit=len(items) or 1)


def report_applies(device_type: str) -> bool:
    """Whether alignment matters on this device type: only CUDA, where tensor cores are.
    On CPU (and MPS) the kernels have no such step in speed, and a warning would be noise. ``cuda:1``
    counts as ``cuda``."""
    return device_type.split(":", 1)[0] == "cuda"


def _layer_items(name: str, module: nn.Linear | nn.modules.conv._ConvNd, multiple: int, first: bool,
                 last: bool) -> list[Misalignment]:
    layer = type(module).__name__
    if isinstance(module, nn.Linear):
        dims = [("in_features", module.in_features, first), ("out_features", module.out_features, last)]
        groups = 1
    else:
        groups = module.groups
        # Depthwise convolutions (one group per input channel) run as per-channel stencils, not
        # GEMMs, so tensor cores do not apply and no channel count would help.
        if groups > 1 and groups == module.in_channels:
            return []
        dims = [("in_channels", module.in_channels, first), ("out_channels", module.out_channels, last)]

    items = []
    for what, value, by_data in dims:
        # Lazy layers report 0 until their first forward: nothing to judge yet.
        if value <= 0 or (value // groups) % multiple == 0:
            continue
        # Each group is its own GEMM, so every group needs the multiple: round the whole layer up
        # to a multiple of groups * multiple.
        suggestion = _round_up(value, groups * multiple)
        note = f"{groups} groups of {value // groups}" if groups > 1 else ""
        if by_data:
            note = _data_note(what, value, suggestion)
        items.append(Misalignment(name, what, value, suggestion, note, layer, by_data))
    return items


def _data_note(what: str, value: int, suggestion: int) -> str:
    if what.startswith("in"):
        unit = "input channel" if what == "in_channels" else "input feature"
        return f"set by the data: {value} {unit}{'s' if value != 1 else ''}; usually left as is"
    return (f"set by the data: {value} classes; padding the classifier to {suggestion} outputs "
            "would align it, rarely worth it")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
