"""The `regularization` group: label smoothing, and mixup/cutmix of training batches on the device.

Mixup and cutmix are torchvision's `v2.MixUp` and `v2.CutMix` on the batch after it reached the
device (docs/config.md, "Accuracy practices"); each pairs every image with its neighbour in the
(shuffled) batch. Label smoothing is applied by the loss, to integer and mixed targets alike.

torch and torchvision are imported where batches are mixed: the keys are checked before the command
line imports them (trainer/configuration/early_checks.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Optional

from trainer.infra.schema import FRACTION, NON_NEGATIVE, ConfigGroup, Doc, UnitInterval, check_keys

if TYPE_CHECKING:
    import torch
    from torchvision.transforms import v2


@dataclass
class RegularizationConfig:
    """The accuracy practices of the loss and the batch (trainer/groups/regularization.py): label smoothing,
    and mixup/cutmix of whole batches on the device, as torchvision's and timm's ImageNet recipes use them."""

    label_smoothing: Annotated[UnitInterval, Doc("share of the target spread evenly over all classes "
                                                 "(training loss only; 0: off)")]
    mixup_alpha: Annotated[float, NON_NEGATIVE, Doc("mixup: blend each image with another, weight ~ "
                                                    "Beta(alpha, alpha) (0: off)")]
    cutmix_alpha: Annotated[float, NON_NEGATIVE, Doc("cutmix: paste a box of another image, area share ~ "
                                                     "Beta(alpha, alpha) (0: off)")]
    mix_prob: Annotated[float, FRACTION, Doc("probability that a training batch is mixed at all")]
    switch_prob: Annotated[float, FRACTION, Doc("with both on: probability of cutmix rather than mixup")]


class BatchMixing:
    """Mixes a training batch as `cfg` says: with probability `mix_prob`, by cutmix (probability
    `switch_prob` when both are on) or mixup. Returns the images and the targets: class
    probabilities (N x classes) for a mixed batch, the integer labels for one left alone."""

    def __init__(self, cfg: RegularizationConfig, num_classes: int) -> None:
        from torchvision.transforms import v2

        self.mix_prob = cfg.mix_prob
        self.switch_prob = cfg.switch_prob
        self.mixup = v2.MixUp(alpha=cfg.mixup_alpha, num_classes=num_classes) if cfg.mixup_alpha > 0 else None
        self.cutmix = v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=num_classes) if cfg.cutmix_alpha > 0 else None

    @property
    def active(self) -> bool:
        return (self.mixup is not None or self.cutmix is not None) and self.mix_prob > 0

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The draws come from torch's global generator (on the CPU, no device sync), which the
        # run seeds and its checkpoints keep (trainer/callbacks/rng.py): a resumed run mixes alike.
        transform = self._choose()
        return (images, labels) if transform is None else transform(images, labels)

    def _choose(self) -> Optional[v2.Transform]:
        import torch  # a lookup in sys.modules once imported: the module's top stays free of torch

        if not self.active or float(torch.rand(())) >= self.mix_prob:
            return None
        if self.mixup is None or self.cutmix is None:
            return self.mixup or self.cutmix
        return self.cutmix if float(torch.rand(())) < self.switch_prob else self.mixup


def describe(cfg: RegularizationConfig) -> str:
    """One line for the start-up plan."""
    parts = []
    if cfg.label_smoothing > 0:
        parts.append(f"label smoothing {cfg.label_smoothing:g}")
    mixes = [f"{name} alpha {alpha:g}" for name, alpha in (("mixup", cfg.mixup_alpha), ("cutmix", cfg.cutmix_alpha))
             if alpha > 0]
    if mixes and cfg.mix_prob > 0:
        how = " or ".join(mixes)
        if len(mixes) == 2:
            how += f" (cutmix {cfg.switch_prob:.0%} of the time)"
        parts.append(f"{how} on {cfg.mix_prob:.0%} of the training batches, on the device")
    return "; ".join(parts) if parts else "off"


GROUP = ConfigGroup("regularization", __name__, "label smoothing, mixup and cutmix (accuracy practices)",
                    lambda values: check_keys("regularization", values, RegularizationConfig),
                    keys=RegularizationConfig)
