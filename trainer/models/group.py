"""The `model` group: a choice names a network (`_target_`: a class or function returning an
`nn.Module`, checked against its signature), the framework fills in what the data say (classes,
channels, image size), and `activation_checkpointing` names the stages it recomputes in backward."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from hydra.utils import instantiate
from torch import nn

from trainer.infra.errors import UserError
from trainer.infra.extras import require
from trainer.infra.instantiation import construct
from trainer.infra.schema import ConfigGroup, check_target, check_value, locate_target

#: Constructor arguments the framework fills in from the data (those the constructor takes).
INJECTED_MODEL_ARGS = ("num_classes", "in_channels", "image_size", "vocab_size", "max_positions", "in_features",
                       "pad_token_id")


def checkpointed_stages(values: Mapping[str, Any]) -> list[str]:
    """The stages to recompute in backward: a framework key inside the group."""
    stages = values.get("activation_checkpointing", [])
    check_value("model.activation_checkpointing", stages, list[str])
    return list(stages)


def validate(values: dict[str, Any]) -> dict[str, Any]:
    """The constructor's keys (without `activation_checkpointing`, see `checkpointed_stages`)."""
    if str(values.get("_target_", "")).startswith("trainer.models.timm."):
        require("timm", "model=timm")
    values = {key: value for key, value in values.items() if key != "activation_checkpointing"}
    return check_target("model", values, skip=INJECTED_MODEL_ARGS, filled_from=" from the data")


def build_model(cfg: Mapping[str, Any], available: Mapping[str, Any],
                required: tuple[str, ...] = ("num_classes",)) -> nn.Module:
    """The network, given what the data say (`available`: num_classes, in_channels, image_size for
    images; vocab_size, max_positions for text; ...) where its constructor takes them. `required`:
    what the task needs the network to take (a classifier its classes, a language model its
    vocabulary)."""
    target = locate_target("model", cfg["_target_"])
    try:
        parameters = inspect.signature(target).parameters
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        injected = {k: v for k, v in available.items() if k in parameters or takes_kwargs}
    except (TypeError, ValueError):
        injected = {k: available[k] for k in required if k in available}
    missing = [name for name in required if name not in injected]
    if missing:
        raise UserError("model._target_", f"'{cfg['_target_']}' takes no {' or '.join(missing)} argument",
                        f"a constructor accepting {', '.join(available)} (those it needs)")
    net = construct("model", lambda: instantiate(dict(cfg), _convert_="all", **injected))
    if not isinstance(net, nn.Module):
        raise UserError("model._target_", f"'{cfg['_target_']}' returned {type(net).__name__}, not an nn.Module",
                        "a class or function that returns a torch.nn.Module")
    return net


GROUP = ConfigGroup("model", __name__, "the network; classes, channels and image size (a vocabulary and context for text) come from the data", validate,
                    target=True, docs={"activation_checkpointing": "stages (dotted module names) recomputed in "
                                       "backward to save activation memory, e.g. [layer3, layer4]"})
