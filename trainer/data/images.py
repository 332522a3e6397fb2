"""What every source of encoded images shares (an image folder, shards): the crops, the decode
paths and where batches are finished. A subclass says where the bytes are: `inspect`, `setup`, and
`_jpeg_share` for the line of the auto decode choice."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Sequence, Union, cast

import torch
from torchvision.transforms import v2

from trainer.data.base import ImageData
from trainer.data.decode import EncodedBatch, Geometry, decode_batch
from trainer.data.progressive_resize import ResizeSchedule
from trainer.data.transforms import normalize, random_flip
from trainer.infra.errors import UserError
from trainer.infra.schema import AT_LEAST_ONE, Doc, Range


class EncodedImagesData(ImageData):
    """Decoded and cropped by loader workers (RandomResizedCrop for training, resize and centre crop
    for evaluation) as 8-bit RGB. With `device_normalize` (default) batches travel as uint8 (a quarter
    of float32's bytes) and are flipped and normalized on the device; otherwise the workers do it."""

    finishes_on_host_itself = True  # torchvision transforms v2 in the workers, in float32
    random_on_host = True  # RandomResizedCrop in the workers: a seed per sample (trainer/data/resumable.py)

    def __init__(
        self,
        image_size: Annotated[int, AT_LEAST_ONE, Doc("side of the square training crop and evaluation "
                                                     "image")] = 224,
        train_crop_scale: Annotated[Sequence[Annotated[float, Range(gt=0, le=1)]],
                                    Doc("RandomResizedCrop's range of the crop's share of the image area")] = (0.08, 1.0),
        hflip: Annotated[bool, Doc("random horizontal flip in training")] = True,
        augment: Annotated[Literal["none", "randaugment", "trivialaugment"],
                           Doc("a policy of random photometric and geometric ops per training image, in the "
                               "loader workers (torchvision's RandAugment or TrivialAugmentWide)")] = "none",
        augment_ops: Annotated[int, AT_LEAST_ONE, Doc("randaugment: ops applied to each image")] = 2,
        augment_magnitude: Annotated[int, Range(ge=0, le=30), Doc("randaugment: strength of each op (0-30)")] = 9,
        eval_crop_fraction: Annotated[float, Range(gt=0, le=1),
                                      Doc("evaluation: resize to image_size / this, then centre crop")] = 0.875,
        mean: Annotated[Sequence[float], Doc("per-channel mean subtracted (0-1 scale)")] = (0.485, 0.456, 0.406),
        std: Annotated[Sequence[Annotated[float, Range(gt=0)]], Doc("per-channel std divided by")] = (0.229, 0.224,
                                                                                                       0.225),
        progressive_resize: Annotated[bool, Doc("train the first epochs on smaller crops, raised to image_size "
                                                "(FFCV, Composer); evaluation stays at image_size")] = False,
        resize_start: Annotated[float, Range(gt=0, le=1), Doc("progressive_resize: the first epochs' crop side, "
                                                              "as a share of image_size")] = 0.5,
        resize_ramp: Annotated[Sequence[Annotated[float, Range(ge=0, le=1)]],
                               Doc("progressive_resize: the share of the epochs over which the side rises "
                                   "linearly, [from, to]; full size from `to` on")] = (0.5, 0.8),
        resize_step: Annotated[Union[Literal["auto"], Annotated[int, AT_LEAST_ONE]],
                               Doc("progressive_resize: sizes are multiples of this; auto: 8 px below 128 px, "
                                   "else 32 px")] = "auto",
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if self.decode == "device" and not self.device_normalize:
            raise UserError("data.decode", "device decodes, crops, flips and normalizes batches on the device, "
                            "which data.device_normalize=false turns off", "data.decode=fast (or pil) with "
                            "data.device_normalize=false, or data.device_normalize=true")
        if augment not in ("none", "randaugment", "trivialaugment"):
            raise UserError("data.augment", f"'{augment}' is not a policy", "none, randaugment, trivialaugment")
        if augment != "none" and self.decode == "device":
            raise UserError("data.augment", f"{augment} runs per image in the loader workers, and data.decode=device "
                            "decodes whole batches on the device", "data.decode=fast (or pil, or auto) with "
                            "data.augment, or data.augment=none")
        self.image_size = image_size
        self.train_crop_scale = tuple(train_crop_scale)
        self.hflip = hflip
        self.augment = augment
        self.augment_ops = augment_ops
        self.augment_magnitude = augment_magnitude
        self.eval_crop_fraction = eval_crop_fraction
        self.mean, self.std = list(mean), list(std)
        self.progressive_resize = progressive_resize
        self.resize_start = float(resize_start)
        self.resize_ramp = tuple(resize_ramp)
        self.resize_step = resize_step
        #: The training crop's side per epoch, once the run applies its plan (`apply_resize`).
        self.resize: Optional[ResizeSchedule] = None
        #: The decode mode in use once resolved for the device (`resolve_decode`): pil, fast or device.
        self.decode_in_use: Optional[str] = None

    def check_image_settings(self) -> None:
        """The settings a constructor cannot check one by one (called by `inspect`)."""
        if len(self.train_crop_scale) != 2 or self.train_crop_scale[0] > self.train_crop_scale[1]:
            raise UserError("data.train_crop_scale", f"{list(self.train_crop_scale)} is not [low, high]",
                            "two numbers in (0, 1], low <= high")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise UserError("data.mean", "mean and std need one value per RGB channel", "lists of 3 numbers")
        if len(self.resize_ramp) != 2 or self.resize_ramp[0] > self.resize_ramp[1]:
            raise UserError("data.resize_ramp", f"{list(self.resize_ramp)} is not [from, to]",
                            "two shares of the epochs in [0, 1], from <= to")

    # -- progressive resizing ---------------------------------------------------------------------
    def resize_schedule(self, epochs: int) -> Optional[ResizeSchedule]:
        """The training sizes of a run of `epochs` epochs (None: every epoch at image_size)."""
        if not self.progressive_resize:
            return None
        return ResizeSchedule.of(self.image_size, self.resize_start, self.resize_ramp, self.resize_step, epochs)

    def apply_resize(self, schedule: Optional[ResizeSchedule]) -> None:
        """Train with `schedule`'s sizes from the next setup on (the plan's, applied by the build phase)."""
        self.resize = schedule
        self.train_set = self.val_set = self.test_set = None

    def training_sizes(self) -> tuple[int, ...]:
        """Every training crop side the run will use (the final one included)."""
        return tuple(sorted(set(self.resize.sizes()) | {self.image_size})) if self.resize else (self.image_size,)

    def sample_bytes(self) -> int:
        """One sample as the loader ships it (uint8 with `device_normalize`, else float32)."""
        return 3 * self.image_size**2 * (1 if self.device_normalize else 4)

    # -- to implement ---------------------------------------------------------------------------
    def _jpeg_share(self) -> float:
        """The share of the source's images that are JPEGs (nvjpeg's format), for decode=auto's line."""
        raise NotImplementedError

    def _encoded_split(self, split: str) -> Any:
        """The data set that made a device-path batch of `split` (its `geometry` and `on_host`)."""
        return {"train": self.train_set, "val": self.val_set, "test": self.test_set}[split]

    # -- decoding -------------------------------------------------------------------------------
    def resolve_decode(self, cuda: bool) -> tuple[str, str]:
        """auto: fast, the host decode, on CUDA too: on the first H200 it was measured on (16 host
        cores), data.decode=device trained ResNet-50 at 0.62x of it end to end (docs/data.md). The
        line says whether device could decode this data instead; it stays a choice (data.decode=device)."""
        if self.decode != "auto":
            how = f"{self.decode} (as configured)"
            if self.decode == "device" and not cuda:
                how = "device (as configured; no CUDA: the same batched path decodes on the CPU, in the training process)"
            return self.decode, how
        if not cuda:
            return "fast", "auto -> fast (no CUDA: decoded on the host)"
        share = self._jpeg_share()
        if not self.device_normalize:
            other = "data.device_normalize=false finishes samples on the host"
        elif self.augment != "none":
            other = f"data.augment={self.augment} runs per image on the host"
        elif share < 0.5:
            other = f"only {share:.0%} of the files are JPEGs, nvjpeg's format"
        else:
            other = f"{share:.0%} of the files are JPEGs: data.decode=device would decode them on the GPU"
        return "fast", (f"auto -> fast (the host decode: data.decode=device measured 0.62x of it end to end on an "
                        f"H200; {other})")

    def apply_decode(self, mode: str) -> None:
        self.decode_in_use = mode

    def use_decode(self, mode: str) -> None:
        self.decode_in_use = mode
        self.train_set = self.val_set = self.test_set = None
        self.setup("fit")

    def decode_choices(self) -> tuple[str, ...]:
        return ("pil", "fast", "device") if self.device_normalize and self.augment == "none" else ("pil", "fast")

    def inference_preprocessing(self) -> dict[str, Any]:
        return {"image": "any format PIL reads, converted to 8-bit RGB", "color": "RGB", "resize": self._eval_resize(),
                "interpolation": "bilinear", "center_crop": [self.image_size, self.image_size], "scale": 1 / 255,
                "mean": list(self.mean), "std": list(self.std), "layout": "NCHW float32"}

    def host_augment(self) -> Optional[v2.Transform]:
        """The training images' augmentation policy, run on each uint8 crop in the loader workers."""
        if self.augment == "randaugment":
            return v2.RandAugment(num_ops=self.augment_ops, magnitude=self.augment_magnitude)
        if self.augment == "trivialaugment":
            return v2.TrivialAugmentWide()
        return None

    def geometry(self, train: bool) -> Geometry:
        finish = None if self.device_normalize else (self.hflip, tuple(self.mean), tuple(self.std))
        scale = cast(tuple[float, float], self.train_crop_scale)  # a pair: inspect() checked it
        return Geometry(self.image_size, train, scale=scale, resize=self._eval_resize(),
                        host_finish=finish)

    def pil_transforms_by_size(self) -> dict[int, v2.Compose]:
        """decode=pil with progressive resizing: the training pipeline for each size of the schedule."""
        return {size: self.pil_transforms(True, size) for size in self.training_sizes()}

    def _eval_resize(self) -> int:
        return max(self.image_size, int(round(self.image_size / self.eval_crop_fraction)))

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Device-path batches are decoded on `device` here (Lightning's default would copy the
        encoded bytes there, where nvjpeg does not read them); other batches as Lightning does."""
        if isinstance(batch, EncodedBatch):
            return decode_batch(batch, self._encoded_split(batch.split), device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def pil_transforms(self, train: bool, size: Optional[int] = None) -> v2.Compose:
        """decode=pil: torchvision's v2 pipeline on the decoded PIL image (training crops of `size`,
        image_size unless given)."""
        if train:
            geometry = [v2.RandomResizedCrop(size or self.image_size, scale=self.train_crop_scale, antialias=True)]
            if self.hflip and not self.device_normalize:
                geometry.append(v2.RandomHorizontalFlip())
            augment = self.host_augment()
            if augment is not None:
                geometry.append(augment)
        else:
            geometry = [v2.Resize(self._eval_resize(), antialias=True), v2.CenterCrop(self.image_size)]
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
