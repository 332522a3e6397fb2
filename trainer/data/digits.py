"""scikit-learn's bundled handwritten digits: 1,797 real 8x8 images, no download."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from trainer.data.base import DataInfo, ImageData, ImageRecord
from trainer.data.transforms import random_translate
from trainer.infra.errors import UserError
from trainer.infra.schema import NON_NEGATIVE, Doc, Range

Fraction = Annotated[float, Range(gt=0, lt=0.5)]


def stratified_split(labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Indices of a seeded split that keeps each class's share in every part."""
    indices = np.arange(len(labels))
    rest, test = train_test_split(indices, test_size=test_fraction, stratify=labels, random_state=seed)
    val_share = val_fraction / (1.0 - test_fraction)
    train, val = train_test_split(rest, test_size=val_share, stratify=labels[rest], random_state=seed)
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


class DigitsDataModule(ImageData):
    """The default data set. Pixel values 0..16 are standardized with the training split's statistics.
    The split is fixed by `split_seed`, independent of the run's seed, so runs with different seeds
    are compared on the same test images."""

    in_memory = True

    def __init__(
        self,
        val_fraction: Annotated[Fraction, Doc("share of the 1,797 images held out for validation")] = 0.15,
        test_fraction: Annotated[Fraction, Doc("share held out for the test")] = 0.15,
        split_seed: Annotated[int, NON_NEGATIVE, Doc("seeds the stratified split (independent of the run's "
                                                     "seed)")] = 0,
        translate: Annotated[int, Range(ge=0, le=3), Doc("random shift by up to this many pixels in training, "
                                                         "on the device")] = 1,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.translate = translate
        self._arrays: Optional[tuple[np.ndarray, np.ndarray]] = None

    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            bunch = load_digits()
            self._arrays = (bunch.images.astype(np.float32), bunch.target.astype(np.int64))
        return self._arrays

    def _check_fractions(self) -> None:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise UserError("data.val_fraction", "val_fraction + test_fraction leaves under 10% for training",
                            "fractions summing to less than 0.9")

    def inspect(self) -> DataInfo:
        images, labels = self._load()
        self._check_fractions()
        sizes = {k: len(v) for k, v in stratified_split(labels, self.val_fraction, self.test_fraction, self.split_seed).items()}
        return DataInfo(ImageRecord(in_channels=1, image_size=(8, 8)), sizes, num_classes=10,
                        class_names=[str(d) for d in range(10)], sample_bytes=8 * 8 * 4)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        images, labels = self._load()
        parts = stratified_split(labels, self.val_fraction, self.test_fraction, self.split_seed)
        x, y = torch.from_numpy(images).unsqueeze(1) / 16.0, torch.from_numpy(labels)
        self._hold_standardized({name: (x[indices], y[indices]) for name, indices in parts.items()})

    def _hold_standardized(self, splits: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The (images, labels) splits as data sets, images standardized with the training split's statistics."""
        mean, std = splits["train"][0].mean(), splits["train"][0].std()
        self._standardized = (float(mean), float(std))
        self.train_set, self.val_set, self.test_set = (TensorDataset((splits[name][0] - mean) / std, splits[name][1])
                                                       for name in ("train", "val", "test"))

    def inference_preprocessing(self) -> dict[str, Any]:
        """The data set's values 0..16 are an 8-bit image's values times 16/255: with ``scale`` 1/255
        both become x/16 before standardization. Its 8x8 pixels are the counts of 4x4 blocks of
        32x32 bitmaps, so a larger client image is reduced by box averaging (``area``)."""
        self.setup()
        mean, std = self._standardized
        return {"image": "a digit, ink bright on dark, any size (reduced to 8x8 grey)", "color": "L",
                "resize": [8, 8], "interpolation": "area", "center_crop": None, "scale": 1 / 255,
                "mean": [mean], "std": [std], "layout": "NCHW float32"}

    def device_transform(self, images: torch.Tensor, training: bool) -> torch.Tensor:
        if training and self.translate:
            # Zero after standardization is not the background value, so shift in raw space.
            background = images.amin(dim=(1, 2, 3), keepdim=True)
            return random_translate(images - background, self.translate) + background
        return images
