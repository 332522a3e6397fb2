"""A training loader that can stop mid-epoch and carry on exactly where it was.

PyTorch's `RandomSampler` and loader workers draw their seeds from the global torch RNG when an
epoch's iterator is created, which a resumed run cannot replay. Here `EpochSampler` orders each
epoch from (seed, epoch) alone and restarts after the batches already trained on, host-side random
transforms draw from a seed given with each index (`SeededSamples`), and every loader has its own
`torch.Generator`, so making an iterator never moves the global RNG that dropout and on-device
augmentation use."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sized, cast

import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

from trainer.infra.errors import UserError

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


class EpochSampler(DistributedSampler):
    """Indices of one epoch, shuffled from (seed, epoch); `seeded` yields
    ``(index, sample_seed)`` pairs for `SeededSamples`, and ``(index, sample_seed, size)`` with a
    `sizes` schedule (persistent loader workers keep their first copy of the data set, so only what
    the sampler sends reaches them each epoch).

    Process `rank` of `replicas` takes items ``rank, rank + replicas, ...`` of each epoch's one order,
    every process the same count. A position counts the items all processes consumed, so a run can
    resume on another number of processes. `taken` counts the batches that reached a training step
    this epoch on this process; `restore` makes the next iterator skip what the checkpointed run had."""

    # A DistributedSampler, so that Lightning uses it as it is (its DistributedSamplerWrapper would
    # re-shuffle the indices). DistributedSampler.__init__ is not called: it asks a process group for the rank.
    def __init__(self, size: int, seed: int, seeded: bool = False, replicas: int = 1,
                 rank: int = 0, sizes: Optional[Callable[[int], int]] = None) -> None:
        if not 0 <= rank < replicas:
            raise ValueError(f"rank {rank} is not one of {replicas} processes")
        self.size = size
        self.seed = seed
        self.seeded = seeded
        self.sizes = sizes
        # DistributedSampler's own attribute names, for code that reads them (Lightning, torch).
        self.num_replicas = replicas
        self.rank = rank
        self.drop_last = True  # every process the same count
        self.epoch = 0
        self.taken = 0
        self._start_items = 0  # items of this epoch's order consumed (by all processes) before the iterator
        self._taken_at_start = 0
        self._resuming = False

    def set_epoch(self, epoch: int) -> None:  # called by Lightning at the start of each epoch
        self.epoch = epoch

    def position(self, batches_per_epoch: float, items_per_batch: int) -> dict[str, int]:
        """Where the next training batch comes from: this epoch after the items taken, or the start
        of the next epoch once this one is through."""
        step = items_per_batch * self.num_replicas
        consumed = self._start_items + (self.taken - self._taken_at_start) * step
        if self.taken >= batches_per_epoch or self.size - consumed < step:
            return {"epoch": self.epoch + 1, "batches": 0, "items": 0, "items_per_batch": items_per_batch,
                    "replicas": self.num_replicas, "size": self.size}
        return {"epoch": self.epoch, "batches": self.taken, "items": consumed, "items_per_batch": items_per_batch,
                "replicas": self.num_replicas, "size": self.size}

    def restore(self, position: dict[str, int]) -> None:
        if int(position["size"]) != self.size:
            raise UserError("resume", f"the training split has {self.size} items but the checkpoint was written "
                            f"with {position['size']}: the data changed, so its order cannot be resumed",
                            "the data of the checkpointed run, or resume=null to start fresh")
        per_batch = int(position["items_per_batch"])
        saved_replicas = int(position.get("replicas", 1))  # checkpoints from before multi-process runs
        self.epoch = int(position["epoch"])
        self._start_items = int(position.get("items", int(position["batches"]) * per_batch * saved_replicas))
        if saved_replicas == self.num_replicas:
            self.taken = int(position["batches"])
        else:  # the batches this process would have taken had the run always had this many processes
            self.taken = self._start_items // (per_batch * self.num_replicas)
        self._taken_at_start = self.taken
        self._resuming = True

    def order(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(mix(self.seed, self.epoch))
        return torch.randperm(self.size, generator=generator)

    def __iter__(self) -> Iterator[Any]:
        if self._resuming:  # the first iterator after `restore` carries on in the checkpointed epoch
            self._resuming = False
            skip = self._start_items
        else:  # a new epoch
            skip = self._start_items = 0
            self.taken = self._taken_at_start = 0
        remaining = self.order()[skip:]
        share = len(remaining) // self.num_replicas
        indices = remaining[self.rank::self.num_replicas][:share].tolist()
        if not self.seeded:
            return iter(indices)
        side = () if self.sizes is None else (self.sizes(self.epoch),)
        return iter([(i, mix(self.seed, self.epoch, i, 1), *side) for i in indices])

    def __len__(self) -> int:
        return self.size // self.num_replicas


class SeededSamples(Dataset[Any]):
    """Loads sample ``index`` with the torch RNG seeded from the seed that comes with it; a data set
    with ``takes_seeds`` gets ``(index, seed)`` itself and draws from its own generator (seeding
    the global RNG costs about 0.25 ms per call, a tenth of decoding a photo)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # Dataset's type has no __len__; map-style ones have it

    def __getitem__(self, item: Any) -> Any:
        # A plain index (an evaluation loader), or a data set that draws from the seed itself.
        if not isinstance(item, tuple) or getattr(self.dataset, "takes_seeds", False):
            return self.dataset[item]
        index, seed, *size = item
        if size:  # progressive resizing: the epoch's crop side
            self.dataset.use_size(size[0])  # type: ignore[attr-defined]
        # A worker's RNG serves nothing else; in the training process, leave its RNG alone.
        with torch.random.fork_rng(devices=[], enabled=get_worker_info() is None):
            torch.manual_seed(seed)
            return self.dataset[index]

    def __getattr__(self, name: str) -> Any:  # e.g. `.samples` or `.classes` of an ImageFolder
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
