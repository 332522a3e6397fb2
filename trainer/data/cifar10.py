"""CIFAR-10 from torchvision's on-disk format, read without network and without running pickles.

torchvision's `CIFAR10` is not used on purpose: it insists on the official files' MD5 sums (so a
subset or a re-pack is "corrupted") and unpickles them unrestricted. The format is simple enough
to read here with an unpickler that accepts only numpy arrays and plain containers."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from trainer.data.base import DataInfo, ImageData, ImageRecord
from trainer.data.transforms import normalize, random_flip, random_translate
from trainer.infra.errors import UserError
from trainer.infra.schema import NON_NEGATIVE, Doc, Range

FOLDER = "cifar-10-batches-py"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that rebuilds numpy arrays and nothing that could run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    try:
        with open(path, "rb") as f:
            entry = _ArraysOnly(io.BytesIO(f.read()), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as ex:
        raise UserError(str(path), f"not a readable CIFAR-10 batch ({ex})", "torchvision's cifar-10-batches-py files") from None
    if not isinstance(entry, dict):
        raise UserError(str(path), "not a CIFAR-10 batch (no dictionary inside)")
    data = entry.get(b"data", entry.get("data"))
    labels = entry.get(b"labels", entry.get("labels"))
    if data is None or labels is None:
        raise UserError(str(path), "not a CIFAR-10 batch (missing data or labels)")
    data = np.asarray(data)
    labels = np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise UserError(str(path), f"unexpected contents: data {data.dtype}{list(data.shape)}, {len(labels)} labels",
                        "uint8 data of shape [N, 3072] and N labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise UserError(str(path), "labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


class CIFAR10DataModule(ImageData):
    """The whole set is held in memory as uint8 (150 MB); batches travel as uint8 and are
    translated, flipped and normalized on the device (on the host, per sample, with
    ``device_normalize=false``)."""

    in_memory = True

    def __init__(
        self,
        root: Annotated[Optional[str], Doc("the folder holding cifar-10-batches-py/ (never downloaded)")] = None,
        val_fraction: Annotated[float, Range(gt=0, lt=0.5), Doc("stratified share of the training batches "
                                                                "held out for validation")] = 0.1,
        split_seed: Annotated[int, NON_NEGATIVE, Doc("seeds the validation hold-out (independent of the run's seed)")] = 0,
        augment: Annotated[bool, Doc("random 4-pixel translation and horizontal flip, on the device")] = True,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.root = root
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.augment = augment
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _folder(self) -> Path:
        if self.root is None:
            raise UserError("data.root", "not set", f"data.root=/path/holding/{FOLDER}, or data=synthetic for a "
                            "throughput-only run")
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise UserError("data.root", f"'{root}' does not exist or is not a folder", f"the folder holding {FOLDER}/")
        return root / FOLDER if (root / FOLDER).is_dir() else root

    def inspect(self) -> DataInfo:
        folder = self._folder()
        train = sorted(folder.glob("data_batch_*"))
        test = folder / "test_batch"
        if not train or not test.is_file():
            raise UserError("data.root", f"no CIFAR-10 batches in '{folder}'",
                            f"{FOLDER}/ with data_batch_1..5 and test_batch (torchvision's format; nothing is downloaded)")
        parts = [read_batch(p) for p in train]
        self._arrays = {"train": (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])),
                        "test": read_batch(test)}
        train_n, test_n = len(self._arrays["train"][1]), len(self._arrays["test"][1])
        val_n = int(round(train_n * self.val_fraction))
        return DataInfo(ImageRecord(3, (32, 32)), {"train": train_n - val_n, "val": val_n, "test": test_n}, 10,
                        class_names=CLASSES, sample_bytes=3 * 32 * 32 * (1 if self.device_normalize else 4))

    def inference_preprocessing(self) -> dict[str, Any]:
        return {"image": "8-bit RGB, resized to 32x32", "color": "RGB", "resize": [32, 32],
                "interpolation": "bilinear", "center_crop": None, "scale": 1 / 255, "mean": list(MEAN),
                "std": list(STD), "layout": "NCHW float32"}

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if not self._arrays:
            self.inspect()
        images, labels = self._arrays["train"]
        split = _train_val_split(labels, self.val_fraction, self.split_seed)
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
        self.train_set = TensorDataset(x[split["train"]], y[split["train"]])
        self.val_set = TensorDataset(x[split["val"]], y[split["val"]])
        test_x, test_y = self._arrays["test"]
        self.test_set = TensorDataset(torch.from_numpy(test_x), torch.from_numpy(test_y))

    def device_transform(self, images: torch.Tensor, training: bool) -> torch.Tensor:
        if training and self.augment:
            images = random_flip(random_translate(images, 4))
        return normalize(images, MEAN, STD)


def _train_val_split(labels: np.ndarray, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Stratified when every class can give at least one image to each side, else a seeded shuffle."""
    indices = np.arange(len(labels))
    present = np.bincount(labels, minlength=10)
    present = present[present > 0]
    val_n = int(round(len(labels) * val_fraction))
    if (present >= 2).all() and len(present) <= val_n <= len(labels) - len(present):
        train, val = train_test_split(indices, test_size=val_n, stratify=labels, random_state=seed)
    else:
        order = np.random.default_rng(seed).permutation(len(labels))
        val, train = order[:val_n], order[val_n:]
    return {"train": np.sort(train), "val": np.sort(val)}
