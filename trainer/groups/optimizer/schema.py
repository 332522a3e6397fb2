"""The `optimizer` group's keys: the framework's own (batch rules, parameter groups, kernel, the lr
range test) beside the constructor arguments of the optimizer class a choice names (`_target_`:
torch's, timm's or a team's own), checked against its signature like any `_target_`.

torch is imported where an optimizer is built, not at the top: the framework's own keys are checked
before the command line imports torch (`check_own_keys`, trainer/configuration/early_checks.py)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from trainer.groups.optimizer.registry import FRAMEWORK_ARGUMENTS, locate_optimizer, recompile_limit_kept, row_of
from trainer.infra.errors import UserError, first_line
from trainer.infra.extras import require
from trainer.infra.schema import (AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Doc, Range, check_keys, check_target,
                                  schema_of_dataclass)

ScalingRule = Literal["sqrt", "linear", "none"]
#: optimizer.lr=find: the lr comes from Lightning's lr range test (trainer/modes/lr_finder.py).
LR_FIND = "find"
#: Lightning's suggestion skips the range test's first 10 losses and its last, and needs 2 more.
FIND_STEPS_MIN = 20


@dataclass
class OptimizerKeys:
    """What every optimizer choice has besides its class's own arguments. `lr` and `weight_decay`
    are given at `ref_batch_size`; the run moves them to its global batch by `lr_scaling` and
    `wd_scaling` (trainer/groups/optimizer/scaling.py)."""

    name: Annotated[str, Doc("the optimizer's name in records and start-up warnings")]
    lr: Annotated[Union[Annotated[float, POSITIVE], Literal["find"]],
                  Doc("learning rate at ref_batch_size, moved to the global batch by lr_scaling; find: Lightning's "
                      "lr range test picks it before training (find_*)")]
    weight_decay: Annotated[float, NON_NEGATIVE, Doc("weight decay at ref_batch_size, moved by wd_scaling")]
    ref_batch_size: Annotated[int, AT_LEAST_ONE, Doc("the global batch at which lr and weight_decay are given")]
    lr_scaling: Annotated[ScalingRule, Doc("lr x (B/ref)^1/2 (sqrt), x B/ref (linear) or as given (none)")]
    wd_scaling: Annotated[ScalingRule, Doc("weight decay x B/ref (linear), x (B/ref)^1/2 (sqrt) or as given")]
    # Decay on norm weights and biases (1-D parameters) only pulls them toward zero for no gain
    # (timm filter_bias_and_bn, torchvision --norm-weight-decay 0).
    decay_norm_and_bias: Annotated[bool, Doc("false: no weight decay on 1-D parameters (norm weights, biases)")]
    implementation: Annotated[Literal["auto", "fused", "foreach", "for_loop"],
                              Doc("optimizer kernel; auto: fused where torch has it for the device (CUDA, the CPU; not under "
                                  "an fp16 GradScaler), else foreach")]
    layer_decay: Annotated[Optional[Annotated[float, Range(gt=0, le=1)]],
                           Doc("layer-wise lr decay: lr x this^k for a parameter k layers below the head "
                               "(models with a group_matcher: timm's, model=encoder; null: off)")]
    # lr=find: the range of Lightning's range test (its defaults are 1e-8..1 and 100 steps).
    find_min_lr: Annotated[float, POSITIVE, Doc("lr=find: the lr the range test starts from")]
    find_max_lr: Annotated[float, POSITIVE, Doc("lr=find: the lr the range test rises to, exponentially")]
    find_steps: Annotated[int, Range(ge=FIND_STEPS_MIN),
                          Doc(f"lr=find: training steps of the range test (>= {FIND_STEPS_MIN}: its suggestion "
                              "leaves out the first 10)")]

    def check(self, prefix: str) -> None:
        if self.find_min_lr >= self.find_max_lr:
            raise UserError(f"{prefix}.find_max_lr", f"{self.find_max_lr:g} is not above find_min_lr "
                            f"{self.find_min_lr:g}", "a range with find_min_lr < find_max_lr, e.g. 1e-6 and 1")


@dataclass
class OptimizerConfig(OptimizerKeys):
    """A validated optimizer choice: the framework's keys, the class (`target`, its import path) and
    the arguments the choice gives it."""

    target: str = ""
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def argument(self, name: str) -> Any:
        """An argument of the optimizer as it will be built: the choice's, else the class's default
        (None where the class has no such argument)."""
        if name in self.arguments:
            return self.arguments[name]
        parameter = inspect.signature(locate_optimizer(self.target)).parameters.get(name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def check_own_keys(values: Mapping[str, Any]) -> OptimizerKeys:
    """The framework's keys of an optimizer choice (`OptimizerKeys`), checked; the class's own
    arguments are left to `validate`."""
    fields = schema_of_dataclass(OptimizerKeys).fields
    return check_keys("optimizer", {k: v for k, v in values.items() if k in fields}, OptimizerKeys)


def validate(values: dict[str, Any]) -> OptimizerConfig:
    keys = schema_of_dataclass(OptimizerKeys)
    own = check_own_keys(values)
    target = values.get("_target_")
    if isinstance(target, str) and target.startswith("timm."):
        require("timm", f"optimizer={own.name}")  # timm's LAMB and LARS
    row = row_of(target) if isinstance(target, str) else None
    fixed = tuple(row.fixed) if row else ()
    with recompile_limit_kept():  # the target's first import may be here
        checked = check_target("optimizer", values, skip=FRAMEWORK_ARGUMENTS + fixed, also=keys,
                               bounds=row.bounds if row else None)
    arguments = {k: tuple(v) if isinstance(v, list) else v for k, v in checked.items()
                 if k not in keys.fields and not (k.startswith("_") and k.endswith("_"))}
    if row is not None and row.check is not None:
        row.check("optimizer", arguments)
    _try_building(own, checked["_target_"], arguments, row.fixed if row else {})
    return OptimizerConfig(**vars(own), target=checked["_target_"], arguments=arguments)


def _try_building(own: OptimizerKeys, target: str, arguments: Mapping[str, Any], fixed: Mapping[str, Any]) -> None:
    """The optimizer made once over a single parameter: what its constructor refuses (a value out of
    its range, two arguments that exclude each other) is one line now, not a traceback when fit
    starts. A class of a team's own is checked as torch's are."""
    import torch

    lr = own.find_min_lr if isinstance(own.lr, str) else own.lr
    try:
        locate_optimizer(target)([torch.nn.Parameter(torch.zeros(1))], lr=lr, weight_decay=own.weight_decay,
                                 **fixed, **arguments)
    except (TypeError, ValueError, RuntimeError) as ex:
        raise UserError("optimizer", f"{target} refused its arguments: {first_line(ex)}",
                        "values its constructor accepts (see its documentation)") from None
