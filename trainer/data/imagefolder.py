"""Images in torchvision's ImageFolder layout: ``root/train/<class>/*``, ``root/val/<class>/*``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence

import torch
from torchvision import datasets
from torchvision.transforms import v2

from trainer.data.base import DataInfo, ImageClassificationData
from trainer.data.transforms import normalize, random_flip
from trainer.errors import UserError
from trainer.schema import AT_LEAST_ONE, Range

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


def scan_split(folder: Path) -> dict[str, int]:
    """Image count per class sub-folder (hidden folders skipped)."""
    counts = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir() and not entry.name.startswith("."):
            counts[entry.name] = sum(
                1 for _, _, files in os.walk(entry.path) for f in files if f.lower().endswith(IMAGE_EXTENSIONS))
    return counts


class _FixedClassesImageFolder(datasets.ImageFolder):
    """ImageFolder whose class indices come from the training split.

    Plain ImageFolder numbers the classes of each folder on its own, so a val/ that lacks one class
    would silently shift every label after it.
    """

    def __init__(self, root: str, class_to_idx: dict[str, int], **kwargs: Any) -> None:
        self._given = class_to_idx
        super().__init__(root, **kwargs)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        present = {e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith(".")}
        mapping = {name: idx for name, idx in self._given.items() if name in present}
        return sorted(mapping, key=mapping.get), mapping


class ImageFolderDataModule(ImageClassificationData):
    """Decoded and cropped on the host by loader workers (RandomResizedCrop for training, resize and
    centre crop for evaluation). Grayscale, palette and RGBA images are converted to RGB.

    With `device_normalize` (default) batches travel as uint8, a quarter of the bytes of float32
    over PCIe and through the workers' shared memory, and are flipped and normalized on the device
    (timm's PrefetchLoader idea); otherwise the workers do it in float32.
    """

    finishes_on_host_itself = True  # torchvision transforms v2 in the workers, in float32

    def __init__(
        self,
        root: Optional[str] = None,
        image_size: Annotated[int, AT_LEAST_ONE] = 224,
        train_crop_scale: Sequence[Annotated[float, Range(gt=0, le=1)]] = (0.08, 1.0),
        hflip: bool = True,
        eval_crop_fraction: Annotated[float, Range(gt=0, le=1)] = 0.875,
        mean: Sequence[float] = (0.485, 0.456, 0.406),
        std: Sequence[Annotated[float, Range(gt=0)]] = (0.229, 0.224, 0.225),
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.root = root
        self.image_size = image_size
        self.train_crop_scale = tuple(train_crop_scale)
        self.hflip = hflip
        self.eval_crop_fraction = eval_crop_fraction
        self.mean, self.std = list(mean), list(std)
        self._classes: Optional[dict[str, int]] = None
        self._splits: dict[str, Path] = {}

    def inspect(self) -> DataInfo:
        if self.root is None:
            raise UserError("data.root", "not set", "data.root=/path/to/dataset (an ImageNet-style folder with train/ and "
                            "val/ class folders), or data=synthetic for a throughput-only run")
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise UserError("data.root", f"'{root}' does not exist or is not a folder",
                            "a folder holding train/ and val/ class folders")
        if len(self.train_crop_scale) != 2 or self.train_crop_scale[0] > self.train_crop_scale[1]:
            raise UserError("data.train_crop_scale", f"{list(self.train_crop_scale)} is not [low, high]",
                            "two numbers in (0, 1], low <= high")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise UserError("data.mean", "mean and std need one value per RGB channel", "lists of 3 numbers")
        counts = {}
        for split in ("train", "val", "test"):
            folder = root / split
            if not folder.is_dir():
                if split == "test":
                    continue
                raise UserError("data.root", f"'{folder}' is missing",
                                "a folder with train/ and val/ (and optionally test/) sub-folders of classes")
            counts[split] = scan_split(folder)
            if sum(counts[split].values()) == 0:
                raise UserError("data.root", f"no images ({', '.join(IMAGE_EXTENSIONS)}) in class folders under '{folder}'",
                                f"{folder}/<class>/<image>")
            self._splits[split] = folder
        train_classes = [name for name, n in counts["train"].items() if n > 0]
        for split in ("val", "test"):
            extra = sorted(set(k for k, n in counts.get(split, {}).items() if n > 0) - set(train_classes))
            if extra:
                raise UserError(str(root / split), f"classes with no training images: {', '.join(extra[:5])}",
                                "the class folders of train/ (or a subset)")
        self._classes = {name: i for i, name in enumerate(train_classes)}
        notes = [] if "test" in counts else ["no test/ folder: test metrics are measured on val/"]
        sizes = {split: sum(c.values()) for split, c in counts.items()}
        if "test" not in sizes:
            sizes["test"] = sizes["val"]
        pixel_bytes = 1 if self.device_normalize else 4
        return DataInfo(len(train_classes), 3, (self.image_size, self.image_size), sizes, notes, train_classes,
                        sample_bytes=3 * self.image_size**2 * pixel_bytes)

    def _transforms(self, train: bool) -> v2.Compose:
        if train:
            geometry = [v2.RandomResizedCrop(self.image_size, scale=self.train_crop_scale, antialias=True)]
            if self.hflip and not self.device_normalize:
                geometry.append(v2.RandomHorizontalFlip())
        else:
            resize = max(self.image_size, int(round(self.image_size / self.eval_crop_fraction)))
            geometry = [v2.Resize(resize, antialias=True), v2.CenterCrop(self.image_size)]
        steps = [v2.ToImage(), *geometry]
        if self.device_normalize:
            # uint8 leaves the worker; `device_transform` finishes the job on the device.
            steps.append(v2.ToPureTensor())
        else:
            steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(self.mean, self.std)]
        return v2.Compose(steps)

    def device_transform(self, images: torch.Tensor, training: bool) -> torch.Tensor:
        if not self.device_normalize:
            return images
        if training and self.hflip:
            images = random_flip(images)
        return normalize(images, self.mean, self.std)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self._classes is None:
            self.inspect()
        assert self._classes is not None

        def make(split: str, train: bool) -> datasets.ImageFolder:
            return _FixedClassesImageFolder(str(self._splits[split]), self._classes, transform=self._transforms(train),
                                            is_valid_file=lambda p: p.lower().endswith(IMAGE_EXTENSIONS),
                                            allow_empty=True)

        self.train_set = make("train", True)
        self.val_set = make("val", False)
        self.test_set = make("test", False) if "test" in self._splits else self.val_set
