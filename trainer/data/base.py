"""What every data module of the framework shares: the loader rules and the device-side hook."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Iterator, Literal, Mapping, Optional, Sized, Union, cast

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer.data.loader import LoaderSettings, resolve_loader
from trainer.data.resumable import EpochSampler, SeededSamples, own_generator
from trainer.data.transfer import SideStreamCopy
from trainer.infra.errors import UserError
from trainer.infra.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Doc

DECODE_MODES = ("auto", "pil", "fast", "device")

Auto = Literal["auto"]
#: batch_size=auto picks a multiple of this, and never less.
AUTO_BATCH_START = 8


class KindRecord:
    """What one kind of data says of its samples (`DataInfo.record`); a team's own kind is a frozen
    dataclass subclassing this one."""

    kind: ClassVar[str]

    def sample_shape(self) -> tuple[int, ...]:
        """One sample's input as the network receives it (what FLOPs are counted and memory is planned with)."""
        raise NotImplementedError

    def model_inputs(self) -> dict[str, Any]:
        """The constructor arguments a network for this data takes from it."""
        raise NotImplementedError


@dataclass(frozen=True)
class ImageRecord(KindRecord):
    """Images of `in_channels` x `image_size` (height, width), as the network receives them."""

    kind: ClassVar[str] = "images"
    in_channels: int
    image_size: tuple[int, int]

    def sample_shape(self) -> tuple[int, ...]:
        return (self.in_channels, *self.image_size)

    def model_inputs(self) -> dict[str, Any]:
        return {"in_channels": self.in_channels, "image_size": list(self.image_size)}


@dataclass(frozen=True)
class TokenRecord(KindRecord):
    """Sequences of `sequence_length` integer token ids below `vocab_size`."""

    kind: ClassVar[str] = "tokens"
    vocab_size: int
    sequence_length: int

    def sample_shape(self) -> tuple[int, ...]:
        return (self.sequence_length,)

    def model_inputs(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "max_positions": self.sequence_length}


@dataclass(frozen=True)
class SequenceRecord(TokenRecord):
    """Labelled sequences of at most `sequence_length` token ids below `vocab_size`, padded with `pad_id`."""

    kind: ClassVar[str] = "sequences"
    pad_id: int = 0
    multi_label: bool = False

    def model_inputs(self) -> dict[str, Any]:
        return {**super().model_inputs(), "pad_token_id": self.pad_id}


@dataclass(frozen=True)
class FeatureRecord(KindRecord):
    """Rows of `in_features` floats (a table)."""

    kind: ClassVar[str] = "features"
    in_features: int

    def sample_shape(self) -> tuple[int, ...]:
        return (self.in_features,)

    def model_inputs(self) -> dict[str, Any]:
        return {"in_features": self.in_features}


@dataclass(frozen=True)
class DataInfo:
    """What the model and the run need to know of a data set before any batch is read; the kind's
    own fields are in `record`."""

    record: KindRecord
    #: Samples per split ("train", "val", "test").
    sizes: dict[str, int]
    #: Classes of a label per sample (0: the data have none, e.g. text for a language model).
    num_classes: int = 0
    class_names: Optional[list[str]] = None
    notes: list[str] = field(default_factory=list)
    #: Bytes of one sample as the loader ships it (uint8 images: 1 per pixel and channel).
    sample_bytes: int = 0
    #: What the `model` group fills in besides the record's and the classes (a team's own arguments).
    inputs: Mapping[str, Any] = field(default_factory=dict)
    #: Reference values of the task's metrics that need no training (a text data set's unigram
    #: perplexity): the run prints and records its own beside them.
    baselines: Mapping[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """What a sample's input is: "images" (C x H x W), "tokens" (T integer ids), "features" (F floats)."""
        return self.record.kind

    def model_inputs(self) -> dict[str, Any]:
        """What the `model` group's builder fills into a network's constructor (those it takes)."""
        classes = {"num_classes": self.num_classes} if self.num_classes else {}
        return {**classes, **self.record.model_inputs(), **self.inputs}

    def input_shape(self) -> tuple[int, ...]:
        """One sample's input shape (what FLOPs are counted and memory is planned with)."""
        return tuple(self.record.sample_shape())

    def summary(self) -> dict[str, Any]:
        """For summary.json: the kind, its record's fields beside it, and the rest."""
        return {"kind": self.kind, "num_classes": self.num_classes, **dataclasses.asdict(cast(Any, self.record)),
                "inputs": self.model_inputs(), "sizes": self.sizes, "notes": self.notes,
                "baselines": dict(self.baselines)}


class DataModule(L.LightningDataModule):
    """Base of every data module, whatever its kind: the batch size, the loaders, the training order
    that resumes mid-epoch, the copy to the device. Subclasses implement `inspect` (cheap checks of
    the source, a `UserError` naming the ``data.*`` key) and `setup` (``train_set``, ``val_set``,
    ``test_set``), and may override `device_transform` to finish whole batches on the device
    (``device_normalize``, timm's PrefetchLoader idea; false: per sample on the host)."""

    #: The data set lives in memory as tensors: loader workers would only add copies.
    in_memory: ClassVar[bool] = False
    #: The module has its own host-side path for ``device_normalize=false`` (else the base class
    #: runs `device_transform` per sample inside the loader).
    finishes_on_host_itself: ClassVar[bool] = False
    #: Its host-side training transforms draw random numbers even with ``device_normalize`` (e.g.
    #: random crops in the workers): each sample then gets its own seed (trainer/data/resumable.py).
    random_on_host: ClassVar[bool] = False

    def __init__(
        self,
        batch_size: Annotated[Union[Annotated[int, AT_LEAST_ONE], Auto],
                              Doc("per device; the global batch multiplies it by devices, nodes and accumulation. "
                                  "auto: the largest multiple of 8 that fits (on a CPU: memory_budget_gb)")] = 64,
        memory_budget_gb: Annotated[Optional[Annotated[float, POSITIVE]],
                                    Doc("batch_size=auto: the memory one training step may use, in GiB (needed "
                                        "on a CPU; on CUDA a cap on what fits)")] = None,
        eval_batch_size: Annotated[Optional[Annotated[int, AT_LEAST_ONE]],
                                   Doc("validation and test batch (null: batch_size)")] = None,
        num_workers: Annotated[Union[Annotated[int, NON_NEGATIVE], Auto],
                               Doc("loader processes; auto: usable CPUs - 1 (max 8), none for in-memory data")] = "auto",
        pin_memory: Annotated[Union[bool, Auto], Doc("page-locked host batches; auto: with CUDA")] = "auto",
        copy_overlap: Annotated[Union[bool, Auto], Doc("copy each batch to the GPU on a side stream, overlapping "
                                                       "the step before; auto: with CUDA and pinned memory")] = "auto",
        persistent_workers: Annotated[Union[bool, Auto], Doc("keep workers between epochs; auto: when there "
                                                             "are workers")] = "auto",
        prefetch_factor: Annotated[Union[Annotated[int, AT_LEAST_ONE], Auto, None],
                                   Doc("batches each worker prepares ahead; auto: 2, fewer when memory is "
                                       "short")] = "auto",
        device_normalize: Annotated[bool, Doc("ship raw batches and finish them (augment, normalize) on the "
                                              "device; false: per sample on the host")] = True,
    ) -> None:
        super().__init__()
        self.device_normalize = device_normalize
        #: batch_size=auto: sized by the batch finder (trainer/modes/batch_finder.py); until then its smallest.
        self.batch_size_auto = batch_size == "auto"
        self.memory_budget_gb = memory_budget_gb
        self._eval_batch_size = eval_batch_size
        self.batch_size = AUTO_BATCH_START if batch_size == "auto" else batch_size
        self.eval_batch_size = eval_batch_size or self.batch_size
        self._loader_request = (num_workers, pin_memory, persistent_workers, prefetch_factor)
        self._copy_overlap = copy_overlap
        self._side_stream_copy = SideStreamCopy()
        self.loader: LoaderSettings | None = None
        self.train_set: Dataset[Any] | None = None
        self.val_set: Dataset[Any] | None = None
        self.test_set: Dataset[Any] | None = None
        #: Set by the run (`attach_run`): its folder, for reports, and its seed, for the training order.
        self.run_dir: Path | None = None
        self.run_seed = 0
        self._train_sampler: EpochSampler | None = None
        self._resume_position: dict[str, int] | None = None
        self._items_per_batch = 1

    def attach_run(self, run_dir: Path | None, seed: int) -> None:
        self.run_dir = run_dir
        self.run_seed = seed

    # -- to implement ---------------------------------------------------------------------------
    def inspect(self) -> DataInfo:
        raise NotImplementedError

    def device_transform(self, images: torch.Tensor, training: bool) -> torch.Tensor:
        return images

    def resolve_decode(self, cuda: bool) -> tuple[str, str]:
        """(the decode mode to use, how it was chosen), changing nothing (`apply_decode` applies it)."""
        return "none", "no image files: nothing to decode"

    def inference_preprocessing(self) -> dict[str, Any]:
        """How a raw sample becomes the network's input at evaluation, for the model card (export,
        serving); empty when there is nothing a client could send (e.g. data made on the device)."""
        return {}

    def decode_choices(self) -> tuple[str, ...]:
        """The decode modes the diagnosis can compare (none for data held decoded)."""
        return ()

    def apply_decode(self, mode: str) -> None:
        """Decode with `mode` from the next setup on (the plan's choice, applied by the build phase)."""

    def use_decode(self, mode: str) -> None:
        """Rebuild the data sets to decode with `mode` (the diagnosis's decode sweep)."""
        raise NotImplementedError(f"{type(self).__name__} decodes nothing")

    def resize_schedule(self, epochs: int) -> Any:
        """Progressive resizing's `ResizeSchedule` for a run of `epochs` epochs; None: one size throughout."""
        return None

    def apply_resize(self, schedule: Any) -> None:
        """Train with `schedule`'s sizes (the plan's); only image sources that crop while decoding can."""
        if schedule is not None:
            raise NotImplementedError(f"{type(self).__name__} cannot resize per epoch")

    def set_batch_size(self, batch_size: int) -> None:
        """The batch the finder chose (and the evaluation batch with it, unless one was given)."""
        self.batch_size = batch_size
        self.eval_batch_size = self._eval_batch_size or batch_size

    # -- shared ---------------------------------------------------------------------------------
    def loader_settings(self, cuda: bool, batch_bytes: int | None = None,
                        available_bytes: int | None = None) -> LoaderSettings:
        """This module's loader request resolved for the device, changing nothing (`apply_loader`
        applies it); `batch_bytes` and `available_bytes` (None: read now) bound the prefetch depth."""
        return resolve_loader(*self._loader_request, in_memory=self.in_memory, cuda=cuda, batch_bytes=batch_bytes,
                              available_bytes=available_bytes, copy_overlap=self._copy_overlap)

    def apply_loader(self, settings: LoaderSettings) -> None:
        """Build every loader from now on with `settings` (the plan's, applied by the build phase)."""
        self.loader = settings

    def train_dataloader(self) -> DataLoader[Any]:
        return self._dataloader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._dataloader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._dataloader(self.test_set, train=False)

    def _dataloader(self, dataset: Dataset[Any] | None, train: bool) -> DataLoader[Any]:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() did not build this split")
        # A run always applies its plan's settings first; a data module used on its own (a notebook's
        # own Trainer) resolves them for the machine it finds.
        loader = self.loader or self.loader_settings(cuda=torch.cuda.is_available())
        host_finishing = not self.device_normalize and not self.finishes_on_host_itself
        if host_finishing:
            dataset = _FinishedOnHost(dataset, self.device_transform, training=train)
        replicas, rank = self._process_share()
        make_collate = getattr(dataset, "collate_fn", None)  # a data set that batches its own way
        collate = make_collate() if callable(make_collate) else None
        sized = cast(Sized, dataset)  # Dataset's type has no __len__; map-style ones have it
        if not train:
            share = EvalShare(len(sized), replicas, rank) if replicas > 1 else None
            return DataLoader(dataset, batch_size=self.eval_batch_size, shuffle=False, sampler=share,
                              generator=own_generator(self.run_seed), collate_fn=collate,
                              **loader.dataloader_kwargs(rank))
        # Training: an order from (seed, epoch) that resumes mid-epoch, not shuffle=True (trainer/data/resumable.py);
        # drop_last: a short last batch skews BatchNorm statistics and recompiles compiled graphs.
        seeded = self.random_on_host or host_finishing
        sampler = self.train_sampler(len(sized), self.batch_size, seeded=seeded)
        return DataLoader(SeededSamples(dataset) if seeded else dataset, sampler=sampler, batch_size=self.batch_size,
                          drop_last=True, generator=own_generator(self.run_seed), collate_fn=collate,
                          **loader.dataloader_kwargs(rank))

    def grouped_batch_loader(self, batches: Dataset[Any]) -> DataLoader[Any]:
        """The training loader of a data set whose items are whole batches (sequences grouped by
        length): their order from the resumable sampler, one batch an item, the loader's rules."""
        loader = self.loader or self.loader_settings(cuda=torch.cuda.is_available())
        _, rank = self._process_share()
        return DataLoader(batches, batch_size=None, sampler=self.train_sampler(len(cast(Sized, batches)), 1),
                          generator=own_generator(self.run_seed), **loader.dataloader_kwargs(rank))

    def train_sampler(self, size: int, items_per_batch: int, seeded: bool = False) -> EpochSampler:
        """The training loader's sampler, placed where a resumed checkpoint left off; with several
        processes (DDP, FSDP), this process's share of each epoch."""
        replicas, rank = self._process_share()
        resize = getattr(self, "resize", None)
        self._train_sampler = EpochSampler(size, self.run_seed, seeded=seeded, replicas=replicas,
                                           rank=rank, sizes=resize.size_at if resize is not None else None)
        self._items_per_batch = items_per_batch
        if self._resume_position is not None:
            self._train_sampler.restore(self._resume_position)
            self._resume_position = None
        return self._train_sampler

    def _process_share(self) -> tuple[int, int]:
        """(processes, this one's rank): each loads its share of every split (DDP, FSDP)."""
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)

    # The place in the data order travels with the data module's state, restored before any loader is
    # made. (The DataLoader's own `state_dict` is loaded only after the loader and its first iterator
    # exist, and is then never applied: it resumed every epoch from its first batch in our tests.)
    def state_dict(self) -> dict[str, Any]:
        if self._train_sampler is None or self.trainer is None:
            return {}
        return {"train_position": self._train_sampler.position(self.trainer.num_training_batches,
                                                               self._items_per_batch)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_position = state_dict.get("train_position")

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's move, on a side stream where the plan says so (trainer/data/transfer.py)."""
        if self.loader is not None and self.loader.copy_overlap:
            return self._side_stream_copy(batch, device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        training = bool(self.trainer is not None and self.trainer.training)
        if training and self._train_sampler is not None:
            self._train_sampler.taken += 1  # this batch reaches a training step (the resume position)
        return self.finish_batch(batch, training=training)

    def finish_batch(self, batch: Any, training: bool) -> Any:
        """A batch on the device as the step receives it (`device_transform` unless finished on the host)."""
        images, labels = batch
        if not self.device_normalize:
            return images, labels
        return self.device_transform(images, training), labels


class ImageData(DataModule):
    """Base of the image data modules: `DataModule` and `data.decode`. Images held decoded in memory
    (digits, CIFAR-10, the synthetic set) have nothing to decode; `EncodedImagesData` decodes files."""

    def __init__(
        self,
        decode: Annotated[Literal["auto", "pil", "fast", "device"],
                          Doc("how image files become training crops: pil (the reference), fast (host), "
                              "device (batched on the GPU); auto: fast (measured faster than device on an H200). "
                              "Data held decoded has nothing to decode")] = "auto",
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if decode not in DECODE_MODES:
            raise UserError("data.decode", f"'{decode}' is not a decode mode", ", ".join(DECODE_MODES))
        self.decode = decode

    def resolve_decode(self, cuda: bool) -> tuple[str, str]:
        held = "images held decoded: nothing to decode"
        if self.decode == "auto":
            return "none", f"auto -> none ({held})"
        return "none", f"{self.decode} -> none (has no effect: {held})"


#: The base's name before it held every kind (a team's folder written then still imports it).
ImageClassificationData = DataModule


class EvalShare(DistributedSampler):
    """One process's share of an evaluation split: every sample exactly once over all processes.
    Not Lightning's DistributedSampler, which pads the split with repeated samples (metrics would
    count some twice); unequal shares are safe as metrics sync once at the epoch's end. Being a
    DistributedSampler keeps Lightning from replacing it."""

    def __init__(self, size: int, replicas: int, rank: int) -> None:  # no process group needed
        self.size, self.num_replicas, self.rank = size, replicas, rank

    def set_epoch(self, epoch: int) -> None:
        pass  # the same order every time

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return len(self._indices())

    def _indices(self) -> range:
        return range(self.rank, self.size, self.num_replicas)


class _FinishedOnHost(Dataset[Any]):
    """Applies a data module's batch transform to one sample at a time, in the loader."""

    def __init__(self, dataset: Dataset[Any], transform: Callable[[torch.Tensor, bool], torch.Tensor],
                 training: bool) -> None:
        self.dataset, self.transform, self.training = dataset, transform, training

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # Dataset's type has no __len__; map-style ones have it

    def __getitem__(self, index: int) -> Any:
        image, label = self.dataset[index]
        return self.transform(image.unsqueeze(0), self.training).squeeze(0), label
