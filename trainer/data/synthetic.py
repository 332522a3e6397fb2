"""Random images made on the device: measures compute with the input pipeline taken out."""

from __future__ import annotations

from typing import Annotated, Any, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from trainer.data.base import DataInfo, ImageData, ImageRecord
from trainer.data.resumable import own_generator
from trainer.infra.errors import UserError
from trainer.infra.schema import AT_LEAST_ONE, NON_NEGATIVE, Doc, Range

_SPLIT_OFFSET = {"train": 0, "val": 1_000_003, "test": 2_000_003}


class _BatchIndices(Dataset[int]):
    """Yields batch numbers only; the images are drawn on the device from them."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> int:
        if index >= self.batches:
            raise IndexError(index)
        return index


class SyntheticDataModule(ImageData):
    """Each class has a fixed random pattern; a sample is ``signal * pattern + N(0, 1)`` noise.
    The loader carries only a batch number; `transfer_batch_to_device` draws the batch on the device
    from a generator seeded by (seed, split, batch number), so every epoch sees the same samples and
    runs are reproducible, with no host work and no host-to-device copy."""

    in_memory = True

    def __init__(
        self,
        num_classes: Annotated[int, Range(ge=2), Doc("classes, each a fixed random pattern")] = 10,
        shape: Annotated[Sequence[Annotated[int, AT_LEAST_ONE]], Doc("channels, height, width")] = (3, 32, 32),
        train_samples: Annotated[int, AT_LEAST_ONE, Doc("images per training epoch")] = 2048,
        val_samples: Annotated[int, AT_LEAST_ONE, Doc("validation images")] = 512,
        test_samples: Annotated[int, AT_LEAST_ONE, Doc("test images")] = 512,
        signal: Annotated[float, NON_NEGATIVE, Doc("pattern strength against unit noise (0: unlearnable "
                                                   "labels)")] = 0.5,
        seed: Annotated[int, NON_NEGATIVE, Doc("seeds the class patterns and the samples")] = 0,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if len(shape) != 3:
            raise UserError("data.shape", f"{list(shape)} is not [channels, height, width]", "a list of 3 integers")
        self.num_classes = num_classes
        self.shape = tuple(int(s) for s in shape)
        self.samples = {"train": train_samples, "val": val_samples, "test": test_samples}
        self.signal = signal
        self.seed = seed
        self._patterns: Optional[torch.Tensor] = None

    def inspect(self) -> DataInfo:
        sizes = {"train": (self.samples["train"] // self.batch_size) * self.batch_size,
                 "val": self.samples["val"], "test": self.samples["test"]}
        notes = ["synthetic: generated on the device, no input pipeline cost"]
        if not self.device_normalize:
            notes.append("device_normalize=false has no effect: batches are made on the device")
        return DataInfo(ImageRecord(self.shape[0], (self.shape[1], self.shape[2])), sizes, self.num_classes,
                        notes=notes, sample_bytes=0)

    def setup(self, stage: Optional[str] = None) -> None:
        # Whole batches only: the loader's batch size is 1 batch number.
        self.train_set = _BatchIndices(self.samples["train"] // self.batch_size)
        self.val_set = _BatchIndices(-(-self.samples["val"] // self.eval_batch_size))
        self.test_set = _BatchIndices(-(-self.samples["test"] // self.eval_batch_size))

    def _dataloader(self, dataset: Any, train: bool) -> Any:
        split = "train" if train else ("val" if dataset is self.val_set else "test")
        # One item is one batch number: the order of batches resumes mid-epoch like any module's.
        sampler = self.train_sampler(len(dataset), 1) if train else None
        return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=0,
                          collate_fn=lambda index: (split, index), generator=own_generator(self.run_seed))

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        split, index = batch
        return self.make_batch(split, int(index), device)

    def finish_batch(self, batch: Any, training: bool) -> Any:
        return batch  # made finished on the device

    def make_batch(self, split: str, index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._patterns is None or self._patterns.device != device:
            g = torch.Generator(device=device).manual_seed(self.seed)
            self._patterns = torch.randn(self.num_classes, *self.shape, generator=g, device=device)
        size = self.batch_size if split == "train" else self.eval_batch_size
        remaining = self.samples[split] - index * size
        n = size if split == "train" else max(1, min(size, remaining))
        g = torch.Generator(device=device).manual_seed(self.seed * 7_919 + _SPLIT_OFFSET[split] + index)
        labels = torch.randint(0, self.num_classes, (n,), generator=g, device=device)
        noise = torch.randn(n, *self.shape, generator=g, device=device)
        return noise + self.signal * self._patterns[labels], labels
