"""Where a training step's memory goes, and what each practice would change: the memory plan.

Measured on a copy of the network (the run's own is not touched), on the run's device, with the
run's optimizer and precision context. What is measured, the model of the peak and what each
practice changes are in docs/diagnosis.md ("The memory plan"): each practice is the same model
with the changed part measured again, not a rule of thumb."""

from __future__ import annotations

import contextlib
import copy
import math
import resource
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from trainer.groups.precision import compute_dtype
from trainer.infra.figures import new_figure, save_png
from trainer.infra.fingerprint import proc_kib

MIB = 2**20
#: The two small batches the activations per sample are measured at.
PROBE_BATCHES = (2, 4)


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[tuple[Any, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


@dataclass
class Activations:
    fixed: float
    per_sample: float
    #: per top-level stage: (bytes per sample it saves, bytes per sample of its input)
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)

    def at(self, batch: int) -> float:
        return self.fixed + batch * self.per_sample


@dataclass
class MemoryPlan:
    batch_size: int
    device: str
    weights: int
    gradients: int
    optimizer_state: int
    activations: Activations
    optimizer_scratch: int
    measured_peak: Optional[int]
    peak_how: str
    practices: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def modelled_peak(self, batch: Optional[int] = None, activations: Optional[float] = None,
                      scratch: Optional[int] = None) -> float:
        saved = self.activations.at(batch or self.batch_size) if activations is None else activations
        step = self.optimizer_scratch if scratch is None else scratch
        return self.weights + self.optimizer_state + max(saved + self.gradients, self.gradients + step)

    @property
    def rest(self) -> Optional[float]:
        return None if self.measured_peak is None else self.measured_peak - self.modelled_peak()

    def parts(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer state": self.optimizer_state,
                "activations": self.activations.at(self.batch_size), "optimizer step scratch": self.optimizer_scratch}

    def lines(self) -> list[str]:
        parts = ", ".join(f"{name} {value / MIB:,.1f}" for name, value in self.parts().items())
        lines = [f"memory plan at batch {self.batch_size} on {self.device} (MiB): {parts}; activations "
                 f"{self.activations.per_sample / MIB:,.3f} per sample + {self.activations.fixed / MIB:,.1f} fixed",
                 f"  peak: modelled {self.modelled_peak() / MIB:,.1f}"
                 + (f", measured {self.measured_peak / MIB:,.1f} ({self.peak_how}); rest {self.rest / MIB:+,.1f}"
                    if self.measured_peak is not None and self.rest is not None else f" ({self.peak_how})")]
        for practice in self.practices:
            lines.append(f"  {practice['practice']}: peak {practice['peak'] / MIB:,.1f} "
                         f"({practice['peak'] / self.modelled_peak() - 1:+.0%}): {practice['how']}")
        return lines + [f"  note: {note}" for note in self.notes]

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "device": self.device, "bytes": self.parts(),
                "activations_per_sample": self.activations.per_sample, "activations_fixed": self.activations.fixed,
                "stages": {name: {"saved_per_sample": saved, "input_per_sample": given}
                           for name, (saved, given) in self.activations.stages.items()},
                "modelled_peak": self.modelled_peak(), "measured_peak": self.measured_peak, "peak_how": self.peak_how,
                "rest": self.rest, "practices": self.practices, "notes": self.notes}


# -- measuring --------------------------------------------------------------------------------------------
def saved_activations(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, loss_fn: Callable[..., Any],
                      forward_context: Callable[[], Any]) -> tuple[int, dict[str, tuple[int, int]]]:
    """Bytes autograd saves for backward in one forward (parameters excluded, each storage once), in
    all and per top-level stage: (saved, input) bytes."""
    parameters = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved: dict[int, int] = {}
    owner: dict[int, str] = {}
    stage_inputs: dict[str, int] = {}
    current: list[str] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = storage.nbytes()
            owner[storage.data_ptr()] = current[-1] if current else ""
        return tensor

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            current.append(name)
            stage_inputs[name] = stage_inputs.get(name, 0) + sum(
                a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if current:
            current.pop()

    handles = []
    for name, child in net.named_children():
        handles.append(child.register_forward_pre_hook(enter(name)))
        handles.append(child.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), forward_context():
            loss = loss_fn(net(images), labels)
        del loss
    finally:
        for handle in handles:
            handle.remove()
    per_stage = {name: (sum(b for ptr, b in saved.items() if owner[ptr] == name), stage_inputs.get(name, 0))
                 for name in stage_inputs}
    return sum(saved.values()), per_stage


def measure_activations(net: nn.Module, make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                        loss_fn: Callable[..., Any], forward_context: Callable[[], Any]) -> Activations:
    small, large = PROBE_BATCHES
    total_small, stages_small = saved_activations(net, *make_batch(small), loss_fn, forward_context)
    total_large, stages_large = saved_activations(net, *make_batch(large), loss_fn, forward_context)
    per_sample = (total_large - total_small) / (large - small)
    stages = {name: ((stages_large[name][0] - stages_small[name][0]) / (large - small),
                     (stages_large[name][1] - stages_small[name][1]) / (large - small)) for name in stages_large}
    return Activations(max(0.0, total_small - small * per_sample), per_sample, stages)


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
          loss_fn: Callable[..., Any], forward_context: Callable[[], Any]) -> None:
    with forward_context():
        loss = loss_fn(net(images), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def _peak(run: Callable[[], Any], device: torch.device, *tracked: Any) -> tuple[int, int]:
    """(peak bytes while `run` runs, bytes allocated before it): on CUDA the allocator's; on the CPU
    the peak of live tensor storages (MemTracker, told of `tracked`), with 0 before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        run()
    return int(tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0)), 0


def optimizer_scratch(net: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Peak bytes the optimizer's step allocates beyond what exists before it (gradients in place)."""
    for p in net.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p) * 1e-6
    try:
        peak, before = _peak(optimizer.step, device, net, optimizer)
        if device.type != "cuda":  # what the step found in place: weights, gradients, state, buffers
            before = storage_bytes([*net.parameters(), *(p.grad for p in net.parameters() if p.grad is not None),
                                    *_state_tensors(optimizer), *net.buffers()])
        return max(0, peak - before)
    finally:
        optimizer.zero_grad(set_to_none=True)


def measured_peak(net: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
                  loss_fn: Callable[..., Any], forward_context: Callable[[], Any], device: torch.device,
                  baseline: int) -> tuple[int, str]:
    """Peak bytes of one whole training step: on CUDA, the allocator's high-water mark above what is
    allocated outside this measurement (everything but `baseline`, the copy's own weights and state);
    on the CPU, the peak of live tensor storages (MemTracker)."""
    peak, before = _peak(lambda: _step(net, optimizer, images, labels, loss_fn, forward_context), device,
                         net, optimizer, images, labels)
    if device.type == "cuda":
        return peak - (before - baseline), "the CUDA allocator's peak"
    return peak - storage_bytes([images, labels]), "the peak of live tensor storages (torch MemTracker)"


def plan_memory(net: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable[..., Any],
                forward_context: Callable[[], Any], device: torch.device, batch_size: int,
                half_context: Optional[Callable[[], Any]] = None,
                make_fused: Optional[Callable[[nn.Module], torch.optim.Optimizer]] = None,
                measure_peak: bool = True, with_practices: bool = True) -> MemoryPlan:
    """The memory plan of a step at `batch_size` (see the module's docstring). `half_context`: the
    autocast of bf16 activations, to measure them; `make_fused`: the optimizer's fused variant."""
    net = copy.deepcopy(net).to(device).train()
    optimizer = make_optimizer(net)
    _step(net, optimizer, *make_batch(PROBE_BATCHES[0]), loss_fn, forward_context)  # the optimizer's state exists now
    trainable = [p for p in net.parameters() if p.requires_grad]
    weights = storage_bytes(list(net.parameters()) + list(net.buffers()))
    gradients = sum(p.numel() * p.element_size() for p in trainable)
    state = storage_bytes(_state_tensors(optimizer))
    activations = measure_activations(net, make_batch, loss_fn, forward_context)
    scratch = optimizer_scratch(net, optimizer, device)
    peak, how = (measured_peak(net, optimizer, *make_batch(batch_size), loss_fn, forward_context, device,
                               weights + state) if measure_peak else (None, "not measured"))
    plan = MemoryPlan(batch_size, str(device), weights, gradients, state, activations, scratch, peak, how)
    if with_practices:
        plan.practices = practices(plan, net, make_batch, loss_fn, half_context, make_fused, device)
    return plan


def practices(plan: MemoryPlan, net: nn.Module, make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
              loss_fn: Callable[..., Any], half_context: Optional[Callable[[], Any]],
              make_fused: Optional[Callable[[nn.Module], torch.optim.Optimizer]],
              device: torch.device) -> list[dict[str, Any]]:
    """What each practice would change, each as the modelled peak with the changed part measured."""
    found: list[dict[str, Any]] = []
    batch = plan.batch_size
    if half_context is not None:
        half = measure_activations(net, make_batch, loss_fn, half_context)
        found.append({"practice": "bf16 activations", "peak": plan.modelled_peak(activations=half.at(batch)),
                      "how": f"saved tensors under bf16 autocast: {half.per_sample / MIB:.3f} MiB per sample "
                             f"against {plan.activations.per_sample / MIB:.3f}"})
    containers = {name for name, child in net.named_children() if any(True for _ in child.children())}
    for name, (saved, given) in sorted(plan.activations.stages.items(), key=lambda item: item[1][1] - item[1][0]):
        if name not in containers or saved - given < 0.05 * plan.activations.per_sample:
            continue  # a single layer, or a stage that saves little more than its input: nothing to gain
        kept = plan.activations.at(batch) - batch * (saved - given)
        found.append({"practice": f"activation checkpointing of {name}", "peak": plan.modelled_peak(activations=kept),
                      "how": f"keeps its input ({given * batch / MIB:.1f} MiB) instead of the "
                             f"{saved * batch / MIB:.1f} MiB it saves; its forward runs again in backward",
                      "stage": name})
    if make_fused is not None:
        fused_net = copy.deepcopy(net)
        try:
            fused = make_fused(fused_net)
            _step(fused_net, fused, *make_batch(PROBE_BATCHES[0]), loss_fn, contextlib.nullcontext)
            scratch = optimizer_scratch(fused_net, fused, device)
        except (RuntimeError, ValueError) as ex:  # no fused kernel for this optimizer on this device
            plan.notes.append(f"fused optimizer not measured: {str(ex).splitlines()[0]}")
        else:
            found.append({"practice": "fused optimizer", "peak": plan.modelled_peak(scratch=scratch),
                          "how": f"the step's scratch {scratch / MIB:.1f} MiB against "
                                 f"{plan.optimizer_scratch / MIB:.1f}"})
    if batch >= 2:
        found.append({"practice": "half the batch, twice the accumulation",
                      "peak": plan.modelled_peak(activations=plan.activations.at(math.ceil(batch / 2))),
                      "how": f"activations at batch {math.ceil(batch / 2)}; the same samples per optimizer step"})
    return found


def autocast_for(precision: str, device: torch.device) -> Callable[[], Any]:
    """The forward context of Lightning's precision string (bf16-mixed, 16-mixed; none for the rest)."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def plot_plan(plan: MemoryPlan, path: Any, title: str) -> None:
    rows = [("this run", plan.modelled_peak()), *((p["practice"], p["peak"]) for p in plan.practices)]
    figure = new_figure(figsize=(12, 4.2))
    (left, right) = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    start = 0.0
    for (name, value), colour in zip(plan.parts().items(), ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#dd8452")):
        left.bar(["modelled"], [value / MIB], bottom=start, color=colour, label=f"{name} {value / MIB:,.1f}")
        start += value / MIB
    if plan.measured_peak is not None:
        left.bar(["measured peak"], [plan.measured_peak / MIB], color="#937860")
    left.set_ylabel("MiB")
    left.set_title(f"batch {plan.batch_size} on {plan.device}", fontsize=9)
    left.legend(fontsize=7)
    right.barh([name for name, _ in rows][::-1], [value / MIB for _, value in rows][::-1], color="#4c72b0")
    right.set_xlabel("modelled peak, MiB")
    right.set_title(title, fontsize=9)
    right.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    save_png(figure, path)


# -- the batch that fits ------------------------------------------------------------------------------------
def largest_batch_within(plan: MemoryPlan, budget: float, multiple: int, limit: int) -> tuple[int, str]:
    """The largest multiple of `multiple` (at most `limit`) whose modelled peak fits `budget` bytes,
    and its derivation; ValueError with the reason when not even `multiple` fits."""
    resident = plan.weights + plan.optimizer_state + plan.gradients
    room = budget - resident
    if plan.optimizer_scratch > room:
        raise ValueError(f"weights, gradients and optimizer state ({resident / MIB:,.1f} MiB) and the optimizer "
                         f"step's scratch ({plan.optimizer_scratch / MIB:,.1f} MiB) alone exceed it")
    per_sample = max(plan.activations.per_sample, 1.0)
    fits = int((room - plan.activations.fixed) // per_sample)
    batch = min(fits, limit) // multiple * multiple
    if batch < multiple:
        raise ValueError(f"{multiple} samples need {plan.modelled_peak(batch=multiple) / MIB:,.1f} MiB")
    peak = plan.modelled_peak(batch=batch)
    capped = " (capped by the training split)" if fits > limit else ""
    return batch, (f"auto -> {batch}{capped}: the largest multiple of {multiple} within {budget / 2**30:g} GiB: "
                   f"weights {plan.weights / MIB:,.1f} + gradients {plan.gradients / MIB:,.1f} + optimizer state "
                   f"{plan.optimizer_state / MIB:,.1f} + activations {plan.activations.per_sample / MIB:.3f} MiB "
                   f"per sample x {batch} = {peak / MIB:,.1f} MiB (activations measured)")


def largest_batch_that_runs(net: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                            make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                            loss_fn: Callable[..., Any], forward_context: Callable[[], Any], device: torch.device,
                            multiple: int, limit: int) -> tuple[int, str]:
    """CUDA: real training steps on a copy of the network, the batch doubled from `multiple` until a
    step runs out of memory (or `limit`), then bisected in multiples of `multiple`."""
    net = copy.deepcopy(net).to(device).train()
    optimizer = make_optimizer(net)
    tried: list[str] = []

    def runs(batch: int) -> bool:
        try:
            _step(net, optimizer, *make_batch(batch), loss_fn, forward_context)
            torch.cuda.synchronize(device)
            tried.append(f"{batch} ok")
            return True
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            tried.append(f"{batch} out of memory")
            return False

    limit = max(multiple, limit // multiple * multiple)
    if not runs(multiple):
        raise ValueError(f"a step of {multiple} samples runs out of memory")
    good, bad = multiple, None
    while bad is None and good < limit:
        candidate = min(good * 2, limit)
        if runs(candidate):
            good = candidate
        else:
            bad = candidate
    while bad is not None and bad - good > multiple:
        middle = (good + bad) // 2 // multiple * multiple
        if runs(middle):
            good = middle
        else:
            bad = middle
    net = optimizer = None  # type: ignore[assignment]  # None: drops the unused copy before the cache is emptied
    torch.cuda.empty_cache()
    capped = " (capped by the training split)" if good == limit else ""
    return good, (f"auto -> {good}{capped}: the largest multiple of {multiple} whose training step ran on "
                  f"{torch.cuda.get_device_name(device)} (tried {', '.join(tried)})")


def reset_peak_memory(device: torch.device) -> bool:
    """Start the peak-memory count afresh for this run; False where the platform cannot.
    On CPU the peak resident set (VmHWM) is reset through /proc/self/clear_refs (Linux >= 4.0), so
    the jobs of a multirun, which share one process, each report their own peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device, reset_done: bool = True) -> dict[str, Any]:
    if device.type == "cuda":
        return {"what": "peak CUDA memory allocated by tensors", "bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.max_memory_reserved(device)}
    high_water = proc_kib("/proc/self/status", "VmHWM") if reset_done else None
    if high_water is not None:
        return {"what": "peak resident memory of the process during this run (CPU run)", "bytes": high_water}
    # ru_maxrss is in KiB on Linux.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"what": "peak resident memory of the process since it started (CPU run)", "bytes": rss}
