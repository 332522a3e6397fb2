"""What the framework knows of an optimizer class beyond its signature: one row each, and only where
there is something to know. A class without a row (any torch optimizer, a team's own) is built from
its `_target_` and arguments as they are; its kernels (fused, foreach) are read from its signature."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Callable, Iterator, Mapping, Optional

from trainer.infra.errors import UserError
from trainer.infra.schema import POSITIVE, UnitInterval, locate_target

#: Constructor arguments the framework fills in: the parameter groups, their lr and weight decay
#: (from the batch rules), and the kernel (`implementation`).
FRAMEWORK_ARGUMENTS = ("params", "lr", "weight_decay", "foreach", "fused")


@contextmanager
def recompile_limit_kept() -> Iterator[None]:
    """Dynamo's recompile limit as it was before the block. Deliberately undoes a library's import:
    importing timm.optim (LAMB, LARS) sets the limit to 1,000,000 for the whole process, for timm's
    Kron optimizer, which the framework does not offer (timm/optim/kron.py); kept, `compile.dynamic=
    false` would recompile for every new shape with no limit reached and no line saying so
    (trainer/groups/compile.py)."""
    import torch._dynamo

    limit = torch._dynamo.config.recompile_limit
    try:
        yield
    finally:
        torch._dynamo.config.recompile_limit = limit


def locate_optimizer(target: str) -> Any:
    """The optimizer class at import path `target` (`locate_target`), Dynamo's limit kept."""
    with recompile_limit_kept():
        return locate_target("optimizer", target)


def _nesterov_needs_momentum(prefix: str, arguments: Mapping[str, Any]) -> None:
    if arguments.get("nesterov") and not arguments.get("momentum"):
        raise UserError(f"{prefix}.nesterov", "needs momentum > 0", "nesterov=false, or momentum in (0, 1)")


#: Bounds the optimizers' signatures do not carry (their constructors check them only when called).
MOMENTUM = {"momentum": UnitInterval}
ADAM = {"betas": tuple[UnitInterval, UnitInterval], "eps": Annotated[float, POSITIVE]}


@dataclass(frozen=True)
class OptimizerRow:
    #: Arguments the framework sets (and refuses in the config), with why in a comment at the row.
    fixed: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: A rule on the arguments, checked when the config is validated: (key prefix, arguments).
    check: Optional[Callable[[str, Mapping[str, Any]], None]] = None
    #: Tighter types than the signature's, so that a bad value names its key at validation.
    bounds: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


ROWS: Mapping[str, OptimizerRow] = MappingProxyType({
    "torch.optim.sgd.SGD": OptimizerRow(check=_nesterov_needs_momentum, bounds=MOMENTUM),
    "torch.optim.adamw.AdamW": OptimizerRow(bounds=ADAM),
    # max_grad_norm=None: timm's LAMB would clip the global gradient norm at 1.0 itself, a second
    # clipping beside the clipping group's, which the run would neither choose nor report.
    "timm.optim.lamb.Lamb": OptimizerRow(fixed=MappingProxyType({"max_grad_norm": None}), bounds=ADAM),
    "timm.optim.lars.Lars": OptimizerRow(check=_nesterov_needs_momentum,
                                         bounds={**MOMENTUM, "trust_coeff": Annotated[float, POSITIVE]}),
})


def row_of(target: str) -> Optional[OptimizerRow]:
    """The row of the class at import path `target` (any alias of it), or None."""
    try:
        cls = locate_optimizer(target)
    except UserError:
        return None  # reported where the target is checked
    return ROWS.get(f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}")


def kernels(cls: Any) -> tuple[str, ...]:
    """The kernels the class offers, by its signature: fused, foreach, and its plain loop."""
    parameters = inspect.signature(cls).parameters
    return tuple(kernel for kernel in ("fused", "foreach") if kernel in parameters) + ("for_loop",)


def kernel_arguments(implementation: str, cls: Any) -> dict[str, Any]:
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"} if "foreach" in kernels(cls) else {}
