"""A training loader that can stop mid-epoch and carry on exactly where it was.

PyTorch's shuffling `RandomSampler` draws its seed from the global torch RNG when an epoch's
iterator is created, and loader workers draw theirs the same way, so the order of an epoch and the
random crops in the workers depend on everything that used the RNG before. A run resumed from a
checkpoint cannot replay that. Here instead:

- `EpochSampler` orders each epoch from (seed, epoch) alone and can start an epoch after the
  batches already trained on. Its `position` is saved with the data module's state in every
  checkpoint and given back to the new sampler before its first iterator exists (see
  `ImageClassificationData.load_state_dict` for why not through Lightning's stateful loaders).
- Host-side random transforms (random crops, or a module's augmentation run per sample in the
  workers) draw from a seed given with each index (`SeededSamples`), so they do not depend on how
  the samples were spread over workers or on which sample a worker served before.
- Every loader gets its own `torch.Generator`, so making an iterator never moves the global RNG
  that dropout and on-device augmentation use (the run saves and restores that one, see
  trainer/callbacks/rng.py).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from trainer.errors import UserError

_MASK = (1 << 63) - 1


def mix(*values: int) -> int:
    """A 63-bit seed from integers (SplitMix64 steps): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (int(value) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & _MASK


def own_generator(seed: int) -> torch.Generator:
    """For a loader's `generator=`: its iterators then draw the workers' base seed from here, not
    from the global RNG."""
    return torch.Generator().manual_seed(mix(seed, 2))


class EpochSampler(Sampler[Any]):
    """Indices of one epoch, shuffled from (seed, epoch) when `shuffle`; `seeded` yields
    ``(index, sample_seed)`` pairs for `SeededSamples`.

    `taken` counts the batches that training has consumed this epoch (the data module counts them
    as they reach the step, so batches only prefetched are not counted); `resume_at` makes the next
    epoch's iterator skip that many items.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True, seeded: bool = False) -> None:
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.seeded = seeded
        self.epoch = 0
        self.taken = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:  # called by Lightning at the start of each epoch
        self.epoch = epoch

    def position(self, batches_per_epoch: float, items_per_batch: int) -> dict[str, int]:
        """Where the next training batch comes from: this epoch after the batches taken, or the
        start of the next epoch once this one is through."""
        if self.taken >= batches_per_epoch:
            return {"epoch": self.epoch + 1, "batches": 0, "items_per_batch": items_per_batch, "size": self.size}
        return {"epoch": self.epoch, "batches": self.taken, "items_per_batch": items_per_batch, "size": self.size}

    def restore(self, position: dict[str, int]) -> None:
        if int(position["size"]) != self.size:
            raise UserError("resume", f"the training split has {self.size} items but the checkpoint was written "
                            f"with {position['size']}: the data changed, so its order cannot be resumed",
                            "the data of the checkpointed run, or resume=null to start fresh")
        self.epoch = int(position["epoch"])
        self.taken = int(position["batches"])
        self._skip = self.taken * int(position["items_per_batch"])

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        generator = torch.Generator().manual_seed(mix(self.seed, self.epoch))
        return torch.randperm(self.size, generator=generator)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if not skip:
            self.taken = 0  # a new epoch (a resumed one keeps the count `restore` gave it)
        indices = self.order()[skip:].tolist()
        if not self.seeded:
            return iter(indices)
        return iter([(i, mix(self.seed, self.epoch, i, 1)) for i in indices])

    def __len__(self) -> int:
        return self.size


class SeededSamples(Dataset[Any]):
    """Loads sample ``index`` with the torch RNG seeded from the seed that comes with it."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: Any) -> Any:
        if not isinstance(item, tuple):  # a plain index (an evaluation loader)
            return self.dataset[item]
        index, seed = item
        if get_worker_info() is not None:  # a worker's RNG serves nothing else
            torch.manual_seed(seed)
            return self.dataset[index]
        with torch.random.fork_rng(devices=[]):  # in the training process: leave its RNG alone
            torch.manual_seed(seed)
            return self.dataset[index]

    def __getattr__(self, name: str) -> Any:  # e.g. `.samples` or `.classes` of an ImageFolder
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
