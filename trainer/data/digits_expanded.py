"""scikit-learn's digits, expanded by seeded distortions into a data set on which the batch size
matters: by default 52,794 training images (42 distortions of each of the 1,257 training
originals), 2,160 for validation and 2,160 for the test, at 16 px. Nothing is downloaded.

Made by `expand`, deterministically from `split_seed` and `distortion_seed`: the originals split
first (stratified 70/15/15, so no digit appears in two splits in any of its distortions), then
drawn through random affine maps and elastic fields (Simard et al. 2003), and cached as uint8 in a
file named by every setting that shapes them, written atomically; docs/data.md gives the steps."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from trainer.data.base import DataInfo, ImageRecord
from trainer.data.digits import DigitsDataModule, stratified_split
from trainer.infra.atomic import replace_atomic
from trainer.infra.errors import UserError
from trainer.infra.schema import NON_NEGATIVE, Doc, Range

#: Bump when the way the images are made changes: older cache files are then not read.
RECIPE_VERSION = 2
#: Originals distorted per grid_sample call (bounds the memory of making the set).
CHUNK = 4096


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpu-practice-trainer"


def _affine_grids(n: int, size: int, generator: torch.Generator, rotation_deg: float, scale: float, shear_deg: float,
                  shift: float) -> torch.Tensor:
    """Sampling grids (n, size, size, 2) of random affine maps around the image centre."""
    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=generator)

    angle = torch.deg2rad(uniform(-rotation_deg, rotation_deg))
    zoom = uniform(1.0 - scale, 1.0 + scale)
    shear = torch.tan(torch.deg2rad(uniform(-shear_deg, shear_deg)))
    shifts = torch.stack([uniform(-shift, shift), uniform(-shift, shift)], 1) * 2  # the image spans [-1, 1]
    cos, sin, one, zero = torch.cos(angle), torch.sin(angle), torch.ones(n), torch.zeros(n)
    rotate = torch.stack([torch.stack([cos, -sin], 1), torch.stack([sin, cos], 1)], 1)
    shear_x = torch.stack([torch.stack([one, shear], 1), torch.stack([zero, one], 1)], 1)
    # Output pixel -> input pixel (what affine_grid takes): sheared, rotated, shrunk by the zoom.
    a = torch.cat([rotate @ shear_x / zoom.view(n, 1, 1), shifts.unsqueeze(2)], 2)
    return F.affine_grid(a, [n, 1, size, size], align_corners=False)


def _elastic_offsets(n: int, size: int, generator: torch.Generator, alpha: float, sigma: float) -> torch.Tensor:
    """Displacements (n, size, size, 2) in grid units: uniform noise smoothed by a Gaussian of
    `sigma` pixels, scaled to `alpha` pixels."""
    noise = torch.rand(n, 2, size, size, generator=generator) * 2 - 1
    radius = max(1, int(math.ceil(3 * sigma)))
    x = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-(x**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    smooth = F.conv2d(F.pad(noise.reshape(n * 2, 1, size, size), (radius, radius, 0, 0), mode="reflect"),
                      kernel.view(1, 1, 1, -1))
    smooth = F.conv2d(F.pad(smooth, (0, 0, radius, radius), mode="reflect"), kernel.view(1, 1, -1, 1))
    # Normalized so that alpha is the typical displacement in pixels whatever sigma is.
    smooth = smooth / smooth.reshape(n * 2, -1).std(dim=1).clamp_min(1e-8).view(-1, 1, 1, 1)
    return (smooth.reshape(n, 2, size, size) * alpha * 2 / size).permute(0, 2, 3, 1)


def expand(originals: np.ndarray, copies: int, size: int, seed: int, rotation_deg: float = 12.0,
           scale: float = 0.12, shear_deg: float = 10.0, shift: float = 0.08, elastic_alpha: float = 0.8,
           elastic_sigma: float = 2.0) -> np.ndarray:
    """`copies` seeded distortions of each 8x8 original (values 0..16), as uint8 (N*copies, size, size),
    original-major (the copies of original i are rows i*copies .. i*copies + copies - 1)."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.from_numpy(np.asarray(originals, dtype=np.float32)).unsqueeze(1) * (255.0 / 16.0)
    # The originals' ink reaches their edges: drawn at 3/4 of the frame (as MNIST's 20 px digits sit
    # in 28 px), a rotation or shift keeps the digit whole.
    inner = max(4, round(size * 0.75))
    source = F.interpolate(source, size=(inner, inner), mode="bilinear", align_corners=False)
    before = (size - inner) // 2
    source = F.pad(source, (before, size - inner - before, before, size - inner - before))
    repeated = source.repeat_interleave(copies, dim=0)
    out = torch.empty(repeated.shape[0], size, size, dtype=torch.uint8)
    for start in range(0, repeated.shape[0], CHUNK):
        batch = repeated[start:start + CHUNK]
        n = batch.shape[0]
        grid = _affine_grids(n, size, generator, rotation_deg, scale, shear_deg, shift)
        grid = grid + _elastic_offsets(n, size, generator, elastic_alpha, elastic_sigma)
        drawn = F.grid_sample(batch, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        out[start:start + n] = drawn.squeeze(1).round().clamp(0, 255).to(torch.uint8)
    return out.numpy()


class ExpandedDigitsDataModule(DigitsDataModule):
    """Digits expanded by seeded affine and elastic distortions (see the module docstring)."""

    def __init__(
        self,
        copies: Annotated[int, Range(ge=1, le=1000), Doc("distortions of each training original (1,257 of them)")] = 42,
        eval_copies: Annotated[int, Range(ge=1, le=1000), Doc("distortions of each validation and test original")] = 8,
        image_size: Annotated[int, Range(ge=8, le=64), Doc("side of the drawn images in pixels")] = 16,
        distortion_seed: Annotated[int, NON_NEGATIVE, Doc("seeds the distortions (independent of the run's seed)")] = 0,
        cache_dir: Annotated[Optional[str], Doc("where the made set is kept (null: ~/.cache/gpu-practice-trainer)")
                             ] = None,
        **digits: Any,
    ) -> None:
        super().__init__(**digits)
        self.copies = copies
        self.eval_copies = eval_copies
        self.image_size = image_size
        self.distortion_seed = distortion_seed
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self._splits: Optional[dict[str, tuple[np.ndarray, np.ndarray]]] = None

    def _settings(self) -> dict[str, Any]:
        return {"version": RECIPE_VERSION, "copies": self.copies, "eval_copies": self.eval_copies,
                "image_size": self.image_size, "distortion_seed": self.distortion_seed, "split_seed": self.split_seed,
                "val_fraction": self.val_fraction, "test_fraction": self.test_fraction}

    def cache_file(self) -> Path:
        key = hashlib.sha256(json.dumps(self._settings(), sort_keys=True).encode()).hexdigest()[:16]
        return self.cache_dir / f"digits_expanded-{key}.npz"

    def expanded(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """split -> (uint8 images N x size x size, labels), from the cache or made now."""
        if self._splits is None:
            self._splits = self._read_cache() or self._make()
        return self._splits

    def _make(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        bunch = load_digits()
        parts = stratified_split(bunch.target, self.val_fraction, self.test_fraction, self.split_seed)
        splits = {}
        for offset, (name, indices) in enumerate(parts.items()):
            copies = self.copies if name == "train" else self.eval_copies
            images = expand(bunch.images[indices], copies, self.image_size, self.distortion_seed * 3 + offset)
            splits[name] = (images, np.repeat(bunch.target[indices].astype(np.int64), copies))
        self._write_cache(splits)
        return splits

    def _read_cache(self) -> Optional[dict[str, tuple[np.ndarray, np.ndarray]]]:
        try:
            with np.load(self.cache_file()) as stored:
                return {name: (stored[f"{name}_images"], stored[f"{name}_labels"]) for name in ("train", "val", "test")}
        except (OSError, KeyError, ValueError):
            return None  # not made yet, or unreadable: made again

    def _write_cache(self, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        # Any: mypy would match np.savez's **kwds to its allow_pickle too (no key has that name).
        arrays: dict[str, Any] = {f"{name}_{kind}": array for name, pair in splits.items()
                                  for kind, array in zip(("images", "labels"), pair)}

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as out:  # a file, not a name: np.savez would add ".npz" to the name
                np.savez(out, **arrays)

        try:
            replace_atomic(self.cache_file(), write)
        except OSError as ex:
            raise UserError("data.cache_dir", f"cannot write the expanded digits to {self.cache_file()}: {ex}",
                            "a writable folder") from None

    def inspect(self) -> DataInfo:
        self._check_fractions()
        sizes = {name: len(labels) for name, (_, labels) in self.expanded().items()}
        return DataInfo(ImageRecord(in_channels=1, image_size=(self.image_size, self.image_size)), sizes, num_classes=10,
                        class_names=[str(d) for d in range(10)], sample_bytes=self.image_size**2 * 4,
                        notes=[f"digits expanded: {self.copies} distortions of each training original, "
                               f"{self.eval_copies} of each validation and test original, {self.image_size} px"])

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        self._hold_standardized({name: (torch.from_numpy(images).unsqueeze(1).float() / 255.0, torch.from_numpy(labels))
                                 for name, (images, labels) in self.expanded().items()})

    def inference_preprocessing(self) -> dict[str, Any]:
        return {**super().inference_preprocessing(), "image": "a digit, ink bright on dark, any size (resized to grey)",
                "resize": [self.image_size, self.image_size], "interpolation": "bilinear"}
