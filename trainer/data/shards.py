"""``data=shards``: images streamed from LitData shards in a folder or on object storage.

Written by ``python -m trainer.data.prepare SRC DST --format shards``; the cache, each rank's share
and resuming mid-epoch are described in docs/data.md. The images are decoded and cropped by the
image folder's code with the folder source's per-sample seed, so an image gets the same crop in the
same epoch from either source, bit for bit."""

from __future__ import annotations

import copy
import logging
import weakref
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
from litdata import StreamingDataLoader, StreamingDataset
from torch.utils.data import DataLoader, Dataset

from trainer.data.badfiles import BadImageError, WorkerSafeUserError, load_rgb
from trainer.data.base import DataInfo, EvalShare, ImageRecord
from trainer.data.decode import EncodedBatch, EncodedImage, Geometry, device_sample, host_sample
from trainer.data.images import EncodedImagesData
from trainer.data.object_store import check_reachable, is_remote, join, read_json, storage_options, store_error
from trainer.data.prepare_shards import DATASET_NAME, FORMAT
from trainer.data.progressive_resize import ResizeSchedule
from trainer.data.resumable import mix, own_generator
from trainer.infra.errors import UserError
from trainer.infra.schema import Doc, Range

log = logging.getLogger("trainer")

_SOURCE_ALLOWED = ("a folder or s3://bucket/prefix written by python -m trainer.data.prepare SRC DST "
                   "--format shards")


class ShardSampleError(WorkerSafeUserError):
    """A sample that cannot be read from its shard: the shard is damaged (it was checked when written)."""


class ShardStream(StreamingDataset):
    """A split of the shards as (image, label) samples, decoded as ``mode`` says."""

    def __init__(self, source: str, split: str, train: bool, mode: str, geometry: Geometry, pil: Any,
                 augment: Any, seed: int, cache_dir: Optional[str], cache_bytes: int,
                 endpoint_url: Optional[str], resize: Optional[ResizeSchedule] = None,
                 pil_by_size: Optional[dict[int, Any]] = None) -> None:
        super().__init__(join(source, split), cache_dir=cache_dir, shuffle=train, drop_last=train, seed=seed,
                         max_cache_size=cache_bytes, storage_options=storage_options(endpoint_url))
        self.source, self.split, self.train, self.mode = source, split, train, mode
        self.geometry, self.pil, self.augment, self.run_seed = geometry, pil, augment, seed
        self.endpoint_url = endpoint_url
        # Progressive resizing: each worker learns the epoch from LitData, so it picks the epoch's
        # size itself (the image folder's sampler sends it instead).
        self.full_geometry = geometry
        self.resize, self.pil_by_size = (resize, pil_by_size) if train else (None, None)

    def __getitem__(self, index: Any) -> tuple[Any, int]:
        if self.resize is not None:
            self._use_size(self.resize.size_at(self.current_epoch - 1))
        try:
            item = super().__getitem__(index)
        except Exception as ex:  # noqa: BLE001 - LitData's reader raises whatever a damaged chunk gives
            failure = _as_user_error(join(self.source, self.split), ex, self.endpoint_url)
            raise ShardSampleError(failure.where, failure.problem, failure.allowed) from None
        return self.decoded(item), int(item["label"])

    def _use_size(self, size: int) -> None:
        self.geometry = self.full_geometry.at(size)
        if self.pil_by_size is not None:
            self.pil = self.pil_by_size[size]

    def sample_seed(self, place: int) -> Optional[int]:
        # LitData counts epochs from 1, Lightning (and the folder source's seeds) from 0.
        return mix(self.run_seed, self.current_epoch - 1, place, 1) if self.train else None

    def decoded(self, item: dict[str, Any]) -> Any:
        data, name = bytearray(item["image"]), join(self.source, self.split, str(item["name"]))
        seed = self.sample_seed(int(item["index"]))
        try:
            if self.mode == "pil":
                return self._with_pil(name, data, seed)
            if self.mode == "device":
                return device_sample(name, data, int(item["index"]), seed, self.geometry)
            return host_sample(name, data, self.geometry, self.augment, seed)
        except BadImageError as ex:
            raise ShardSampleError(name, f"damaged in the shard ({ex.reason}: {ex.detail})",
                                   "shards written whole by python -m trainer.data.prepare") from None

    def _with_pil(self, name: str, data: bytearray, seed: Optional[int]) -> Any:
        image = load_rgb(name, data=data)
        if seed is None:
            return self.pil(image)
        with torch.random.fork_rng(devices=[]):  # torchvision's v2 transforms draw from the global RNG
            torch.manual_seed(seed)
            return self.pil(image)

    def on_host(self, item: EncodedImage) -> tuple[torch.Tensor, Optional[int]]:
        """A JPEG the device decoder refused, decoded here from the same seed (the same box)."""
        return item.on_host(self.split, self.full_geometry), None


class ShardLoader(StreamingDataLoader):
    """LitData's loader, whose position travels with the data module's state instead of Lightning's
    loader states: Lightning saves a loader's state as it stands, one prefetched batch ahead of the
    steps taken, and would restore it so (the batch fetched but not trained on would be lost)."""

    def _get_iterator(self) -> Any:
        # LitData iterates torch's iterator out of Lightning's reach: kept so that `close` can stop its
        # workers when the run fails (they ignore SIGTERM, and the exit would wait for them forever).
        # Weakly: an iterator nobody holds still shuts its workers down when collected, as torch's do.
        iterator = super()._get_iterator()
        self.live: Optional[weakref.ref[Any]] = weakref.ref(iterator)
        return iterator

    def close(self) -> None:
        live = getattr(self, "live", None)
        iterator = live() if live is not None else None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.live = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        if obj:
            super().load_state_dict(obj)

    def position(self, taken: int) -> dict[str, Any]:
        """LitData's state after `taken` batches of this epoch (0: the epoch is not begun)."""
        if taken <= 0 or taken >= len(self):
            ended = self.current_epoch if taken > 0 else self.current_epoch - 1
            return {"epoch_done": max(0, ended)}
        state = copy.deepcopy(super().state_dict())
        samples = taken * int(self.batch_size or 1)
        state["num_samples_yielded"] = samples
        state["latest_worker_idx"] = (taken - 1) % max(1, self.num_workers)
        state["dataset"]["num_samples_yielded"] = samples
        state["dataset"]["sample_in_epoch"] = samples * int(state["dataset"].get("world_size", 1))
        return {"litdata": state, "taken": taken}

    def resume_at(self, position: dict[str, Any]) -> int:
        """Place the loader where `position` says; the batches of this epoch already taken."""
        if "epoch_done" in position:
            self.current_epoch = int(position["epoch_done"])
            return 0
        super().load_state_dict(position["litdata"])
        return int(position["taken"])


class _Indexed(Dataset[Any]):
    """A split of the shards read by index (LitData's random access), for evaluation."""

    def __init__(self, stream: ShardStream, size: int) -> None:
        self.stream, self.size, self.split = stream, size, stream.split

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.stream[index]


class EvalBlocks(EvalShare):
    """One process's contiguous block of an evaluation split: every sample once over all processes,
    and each process reads only the chunks of its block."""

    def _indices(self) -> range:
        return range(self.rank * self.size // self.num_replicas, (self.rank + 1) * self.size // self.num_replicas)


class ShardsDataModule(EncodedImagesData):
    """Images from shards (see the module docstring); every image option is the image folder's."""

    def __init__(
        self,
        source: Annotated[Optional[str], Doc("the shards: a folder or s3://bucket/prefix written by python -m "
                                             "trainer.data.prepare SRC DST --format shards")] = None,
        endpoint_url: Annotated[Optional[str], Doc("an S3-compatible store that is not AWS (MinIO, Ceph, R2); "
                                                   "null: AWS_ENDPOINT_URL, else AWS")] = None,
        cache_dir: Annotated[Optional[str], Doc("where chunks of a remote source are cached (null: LitData's "
                                                "default, under the home folder)")] = None,
        cache_limit_gb: Annotated[float, Range(gt=0), Doc("the most the cache holds; chunks already read are "
                                                          "evicted beyond it")] = 50.0,
        **images: Any,
    ) -> None:
        super().__init__(**images)
        self.source = source
        self.endpoint_url = endpoint_url
        self.cache_dir = cache_dir
        self.cache_limit_gb = float(cache_limit_gb)
        self._described: Optional[dict[str, Any]] = None
        self._loader: Any = None
        self._taken = 0
        self._counted_epoch = -1
        self._resume: Optional[dict[str, Any]] = None

    # -- before training ----------------------------------------------------------------------------
    def inspect(self) -> DataInfo:
        if self.source is None:
            raise UserError("data.source", "not set", _SOURCE_ALLOWED)
        self.check_image_settings()
        if not is_remote(self.source) and not Path(self.source).expanduser().is_dir():
            raise UserError("data.source", f"'{self.source}' does not exist or is not a folder", _SOURCE_ALLOWED)
        check_reachable(self.source, self.endpoint_url)
        described = read_json(self.source, DATASET_NAME, self.endpoint_url)
        if not isinstance(described, dict) or described.get("format") != FORMAT:
            raise UserError("data.source", f"no complete shards at '{self.source}' ({DATASET_NAME} is missing: "
                            "not written, or the writing did not finish)", _SOURCE_ALLOWED)
        self._described = described
        sizes = dict(described["sizes"])
        notes = [f"shards at {self.source}: {', '.join(f'{k} {v}' for k, v in sizes.items())} images"]
        if "test" not in sizes:
            notes.insert(0, "no test split: test metrics are measured on val")
            sizes["test"] = sizes["val"]
        classes = list(described["classes"])
        return DataInfo(ImageRecord(3, (self.image_size, self.image_size)), sizes, len(classes), classes, notes,
                        sample_bytes=self.sample_bytes())

    def _jpeg_share(self) -> float:
        return float((self._described or {}).get("jpeg_share", 0.0))

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self._described is None:
            self.inspect()
        assert self._described is not None and self.source is not None
        if self.decode_in_use is None:  # used on its own, not by a run (which applies its plan's mode)
            self.apply_decode(self.resolve_decode(cuda=torch.cuda.is_available())[0])
        try:
            def make(split: str, train: bool) -> Any:
                assert self.source is not None
                return ShardStream(self.source, split, train, self.decode_in_use or "fast", self.geometry(train),
                                   self.pil_transforms(train), self.host_augment() if train else None, self.run_seed,
                                   self.cache_dir, int(self.cache_limit_gb * 1e9), self.endpoint_url,
                                   self.resize, self.pil_transforms_by_size() if self.resize else None)

            self.train_set = make("train", True)
            self.val_set = make("val", False)
            self.test_set = make("test", False) if "test" in self._described["sizes"] else self.val_set
        except UserError:
            raise
        except Exception as ex:  # noqa: BLE001 - boto3's and LitData's own errors, made one line
            raise _as_user_error(self.source, ex, self.endpoint_url) from None

    # -- loaders ------------------------------------------------------------------------------------
    def train_dataloader(self) -> Any:
        self._loader = self._stream_loader(self.train_set, train=True)
        if self._resume is not None:
            self._taken = self._loader.resume_at(self._resume)
            self._counted_epoch = self._loader.current_epoch
        return self._loader

    def val_dataloader(self) -> Any:
        return self._stream_loader(self.val_set, train=False)

    def test_dataloader(self) -> Any:
        return self._stream_loader(self.test_set, train=False)

    def _stream_loader(self, dataset: Any, train: bool) -> Any:
        if dataset is None:
            raise RuntimeError("ShardsDataModule.setup() did not build this split")
        settings = self.loader or self.loader_settings(cuda=torch.cuda.is_available())
        replicas, rank = self._process_share()
        kwargs = settings.dataloader_kwargs(rank)
        collate = partial(EncodedBatch, dataset.split) if self.decode_in_use == "device" else None
        if not train:
            # Evaluation reads each process's block of the split by index, every sample once, as the
            # image folder's EvalShare does. LitData's own split of a small split can give one rank
            # twice the batches of another, and the ranks' epoch-end collectives then fall out of step.
            assert self._described is not None
            size = int(self._described["sizes"][dataset.split])
            return DataLoader(_Indexed(dataset, size), batch_size=self.eval_batch_size, shuffle=False,
                              sampler=EvalBlocks(size, replicas, rank) if replicas > 1 else None,
                              collate_fn=collate, generator=own_generator(self.run_seed), **kwargs)
        # Each epoch's workers get the dataset with that epoch's number (LitData shuffles by it and
        # the crops' seeds follow it); persistent workers would keep the first epoch's copy.
        kwargs["persistent_workers"] = False
        return ShardLoader(dataset, batch_size=self.batch_size, drop_last=True, collate_fn=collate,
                           generator=own_generator(self.run_seed), **kwargs)

    # -- the place in the epoch ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._loader is None:
            return {}
        return {"stream_position": self._loader.position(self._taken)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = state_dict.get("stream_position")

    def on_exception(self, exception: BaseException) -> None:
        """A failed run stops the training loader's workers (see `ShardLoader.close`)."""
        if self._loader is not None:
            self._loader.close()

    def teardown(self, stage: str) -> None:
        if self._loader is not None:
            self._loader.close()

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        training = bool(self.trainer is not None and self.trainer.training)
        if training and self._loader is not None:
            if self._loader.current_epoch != self._counted_epoch:  # the first batch of a new epoch
                self._counted_epoch, self._taken = self._loader.current_epoch, 0
            self._taken += 1
            self._resume = None  # training has begun where the checkpoint said
        return self.finish_batch(batch, training=training)


#: How obstore (LitData's chunk reader) words a store it cannot reach, after its own retries.
_UNREACHABLE_WORDS = ("error sending request", "connection refused", "connect error", "timed out", "dns error")


def _as_user_error(source: str, ex: BaseException, endpoint_url: Optional[str]) -> UserError:
    """A failure to open or read the shards, as one line: the store's refusals (boto3's errors, or
    obstore's words for an unreachable store) as `store_error` says them; anything else is a chunk
    that cannot be read."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(ex, (ClientError, BotoCoreError)):
        return store_error(source, ex, endpoint_url)
    text = str(ex).splitlines()[0] if str(ex) else type(ex).__name__
    if is_remote(source) and any(words in str(ex).lower() for words in _UNREACHABLE_WORDS):
        endpoint = storage_options(endpoint_url).get("endpoint_url", "AWS's endpoint")
        return UserError(source, f"the store at {endpoint} cannot be reached (after retries)",
                         "a running store: data.endpoint_url (or AWS_ENDPOINT_URL) naming it")
    return UserError(source, f"a chunk cannot be read ({type(ex).__name__}: {text})",
                     "shards written whole by python -m trainer.data.prepare (rerun it into a new DST)")

