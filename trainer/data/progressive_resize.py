"""Progressive resizing: train the first epochs on smaller crops and raise the size to the final one,
as FFCV's ResNet recipes and MosaicML Composer's ``ProgressiveResizing`` do (docs/data.md,
"Progressive resizing"). Evaluation always runs at the final size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

#: Below this final size the sizes move in steps of 8 px, from it on in steps of 32 (FFCV and
#: Composer round ImageNet sizes to 32; a 32 px digit has only 16 and 24 below it at 8).
SMALL_IMAGE_SIDE = 128


def size_step(final: int, step: Any) -> int:
    """The size increment: `step` when given, else 8 px for small images and 32 px for others."""
    if step != "auto":
        return int(step)
    return 8 if final < SMALL_IMAGE_SIDE else 32


@dataclass(frozen=True)
class ResizeSchedule:
    """The training crop's side for every epoch: `start` until `ramp[0]` of the epochs, then rising
    linearly to `final` at `ramp[1]`, rounded to multiples of `step`; full size from there on."""

    final: int
    start: int
    ramp: tuple[float, float]
    step: int
    epochs: int

    @classmethod
    def of(cls, final: int, start_share: float, ramp: Sequence[float], step: Any, epochs: int) -> ResizeSchedule:
        increment = size_step(final, step)
        start = final if start_share >= 1 else min(final, max(increment, int(round(final * start_share / increment))
                                                            * increment))
        return cls(final, start, (float(ramp[0]), float(ramp[1])), increment, max(1, int(epochs)))

    def size_at(self, epoch: int) -> int:
        """The side of epoch `epoch` (0-based); epochs past the schedule train at the final size."""
        progress = epoch / self.epochs
        low, high = self.ramp
        if progress >= high or epoch >= self.epochs:
            return self.final
        if progress < low:
            return self.start
        raised = self.start + (self.final - self.start) * (progress - low) / max(high - low, 1e-12)
        return min(self.final, max(self.start, int(round(raised / self.step)) * self.step))

    def sizes(self) -> list[int]:
        return [self.size_at(epoch) for epoch in range(self.epochs)]

    def relative_cost(self) -> float:
        """The pixels of the whole schedule against every epoch at the final size (what a network's
        convolutions cost scales with)."""
        return sum(size * size for size in self.sizes()) / (self.epochs * self.final * self.final)

    def describe(self) -> str:
        sizes = self.sizes()
        runs = [f"{size} px x{sizes.count(size)}" for size in dict.fromkeys(sizes)]
        return (f"{' -> '.join(runs)} epochs (start {self.start} px = {self.start / self.final:.2f} of "
                f"{self.final}, raised over {self.ramp[0]:.0%}-{self.ramp[1]:.0%} of training in {self.step} px "
                f"steps; {self.relative_cost():.2f}x the pixels of full size); evaluation at {self.final} px")


def epochs_of_run(max_epochs: Optional[int], max_steps: Optional[int], steps_per_epoch: int) -> int:
    """The epochs a run trains: `max_epochs`, or as many as `max_steps` optimizer steps take."""
    if max_epochs is not None and max_epochs > 0:
        return int(max_epochs)
    if max_steps is not None and max_steps > 0:
        return max(1, math.ceil(max_steps / max(1, steps_per_epoch)))
    return 1000  # Lightning's default when neither is set
