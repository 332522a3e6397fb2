"""The `compile` group: torch.compile of the network, in place.

torch is imported where it is used: the keys are checked before the command line imports it
(trainer/configuration/early_checks.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Mapping, Optional

from trainer.infra.schema import ConfigGroup, Doc, check_keys

if TYPE_CHECKING:
    from torch import nn


@dataclass
class CompileConfig:
    """torch.compile of the network. ``mode`` off leaves the model eager; auto compiles on CUDA."""

    mode: Annotated[Literal["off", "auto", "default", "reduce-overhead", "max-autotune"],
                    Doc("torch.compile mode; auto: default on CUDA, eager elsewhere")]
    fullgraph: Annotated[bool, Doc("fail instead of falling back to eager at a graph break")]
    dynamic: Annotated[Optional[bool], Doc("dynamic shapes: true, false, or null to let torch decide")]


def resolve_compile_mode(mode: str, accelerator: str) -> tuple[str, str]:
    """`auto` compiles on CUDA only: on CPU, Inductor's compile time (minutes for a ResNet) buys
    little for the models this framework trains, so compiling there is an explicit choice."""
    if mode != "auto":
        return mode, f"{mode} (as configured)"
    if accelerator == "cuda":
        return "default", "auto -> default (CUDA)"
    return "off", f"auto -> off (no CUDA; compile=default compiles on {accelerator} too)"


def graphs_for_sizes(sizes: int) -> int:
    """The graphs a progressively resized run may compile: Dynamo guards on the input's height and
    width, so each training size recompiles once (measured on torch 2.14: automatic dynamic shapes
    did not merge them, the grad-mode guard of evaluation keeps its graphs apart), and evaluation
    adds its own at the final size, plus one for a short last batch; with room to spare."""
    return 2 * sizes + 4


def recompile_note(sizes: int) -> str:
    import torch

    limit = torch._dynamo.config.recompile_limit
    needed = graphs_for_sizes(sizes)
    if needed <= limit:
        return f"progressive resizing: {sizes} sizes, one compile each (within Dynamo's recompile limit {limit})"
    return (f"progressive resizing: {sizes} sizes, one compile each; Dynamo's recompile limit raised from {limit} "
            f"to {needed} (past it Dynamo would run the network eager without a word)")


def allow_recompiles(sizes: int) -> None:
    """Raise Dynamo's per-function recompile limit (process-wide) to cover `sizes` training sizes."""
    import torch

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs_for_sizes(sizes))


def resolve_dynamic(cfg: CompileConfig, variable_shapes: bool) -> tuple[Optional[bool], str]:
    """Dynamic shapes for batches whose shape varies (bucketed sequences padded per batch): one
    graph with a symbolic length instead of a recompile per length. As configured otherwise."""
    if cfg.dynamic is None and variable_shapes:
        return True, "dynamic shapes (null -> true: the batches' lengths vary)"
    return cfg.dynamic, f"dynamic={cfg.dynamic}"


def apply_compile(net: nn.Module, mode: str, cfg: CompileConfig, dynamic: Optional[bool] = None) -> None:
    """Compile `net` in place in the resolved `mode` (see `resolve_compile_mode`); ``off`` leaves it eager.
    `nn.Module.compile` (not `torch.compile(net)`) keeps the module and its state-dict keys as they
    are, so checkpoints never carry `_orig_mod.` prefixes. `dynamic`: the plan's (`resolve_dynamic`)."""
    if mode != "off":
        net.compile(mode=mode, fullgraph=cfg.fullgraph, dynamic=cfg.dynamic if dynamic is None else dynamic)


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counts so far: frames compiled (each recompile is one more), graphs,
    graph breaks, and the times a function reached Dynamo's recompile limit (its calls of a shape
    not compiled yet then run eager, with a warning only in Dynamo's log); a run records the
    difference over its fit."""
    import torch

    counters = torch._dynamo.utils.counters
    limit_hits = sum(count for reason, count in counters["unimplemented"].items() if "recompile limit" in reason.lower())
    return {"frames_compiled": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())), "recompile_limit_hits": int(limit_hits)}


def compiled_line(compiled: Mapping[str, Any]) -> str:
    """The line a fit ends with about what Dynamo compiled (summary.json's ``compiled``): every frame
    after the first is a recompile (a new length with dynamic=false, evaluation's grad mode), and a
    recompile limit reached means some batches ran eager."""
    import torch

    frames = compiled["frames_compiled"]
    line = (f"compile: {frames} frame(s) compiled in fit ({max(0, frames - 1)} recompile(s)), {compiled['graphs']} "
            f"graph(s), {compiled['graph_breaks']} graph break(s), dynamic={compiled['dynamic']}")
    if compiled.get("recompile_limit_hits"):
        line += (f"; Dynamo's recompile limit ({torch._dynamo.config.recompile_limit}) was reached: batches of shapes past it ran eager"
                 + (" (compile.dynamic=true compiles one graph for every length)" if compiled["dynamic"] is False else ""))
    return line


GROUP = ConfigGroup("compile", __name__, "torch.compile of the network",
                    lambda values: check_keys("compile", values, CompileConfig), keys=CompileConfig)
