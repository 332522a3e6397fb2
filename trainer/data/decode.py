"""Image files to training crops, three ways (``data.decode``), each giving the same samples
(docs/data.md): ``pil``, the reference (`ImageFiles`); ``fast``, the same crops for less host time
(`DecodedFiles`); ``device``, each batch decoded, cropped and resized on the device (`EncodedFiles`,
`decode_batch`), a file the device decoder is not given or refuses decoded on the host. Every mode
draws the crop box with torchvision's RandomResizedCrop algorithm from the sample's seed."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as nn_functional
import torchvision.transforms.v2.functional as F
from PIL import Image
from torch.utils.data import get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg

from trainer.data.badfiles import CORRUPT, BadFileList, BadImageError, ImageFiles, Policy, load_rgb, read_bytes
from trainer.data.transforms import normalize

JPEG_EXTENSIONS = (".jpg", ".jpeg")

# SOF markers: C0 baseline, C1 extended, C2 progressive; C3 lossless, C5-C7 differential, C9-CB and
# CD-CF arithmetic-coded. C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_DEVICE_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})


@dataclass(frozen=True)
class JpegHeader:
    height: int
    width: int
    components: int
    precision: int
    frame: int  # the SOF marker's second byte
    complete: bool  # the file ends with the end-of-image marker (trailing padding allowed)

    @property
    def device_decodable(self) -> bool:
        """Whether nvjpeg is given the file: 8-bit Huffman-coded grey or YCbCr, not cut short."""
        return self.complete and self.precision == 8 and self.components in (1, 3) and self.frame in _DEVICE_FRAMES


def jpeg_header(data: Union[bytes, bytearray, memoryview]) -> Optional[JpegHeader]:
    """The frame header of a JPEG, or None when `data` is not one (or the header is cut off).
    Walks the marker segments up to the first frame (SOF) segment; reads nothing else."""
    size = len(data)
    if size < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    at = 2
    while at + 4 <= size:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        length = (data[at + 2] << 8) | data[at + 3]
        if marker in _FRAME_MARKERS:
            if at + 10 > size or length < 8:
                return None
            return JpegHeader(height=(data[at + 5] << 8) | data[at + 6], width=(data[at + 7] << 8) | data[at + 8],
                              components=data[at + 9], precision=data[at + 4], frame=marker,
                              complete=_ends_with_eoi(data))
        if marker == 0xDA or length < 2:  # scan data before any frame: not a JPEG we can use
            return None
        at += 2 + length
    return None


def _ends_with_eoi(data: Union[bytes, bytearray, memoryview]) -> bool:
    # Some writers pad after the end marker; a file cut off mid-scan has no end marker at all
    # (inside entropy-coded data an 0xFF byte is always followed by 0x00 or a restart marker).
    tail = bytes(data[-64:]).rstrip(b"\x00\r\n ")
    return tail.endswith(b"\xff\xd9")


# -- geometry ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """What a sample becomes: a `size`-square crop; in training a random-resized crop (`scale`,
    `ratio`) and, when finished on the host, a flip and normalization; in evaluation the centre
    after resizing the shorter side to `resize`."""

    size: int
    train: bool
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    resize: int = 256
    host_finish: Optional[tuple[bool, Sequence[float], Sequence[float]]] = None  # (hflip, mean, std)

    def at(self, size: Optional[int]) -> Geometry:
        """The same geometry with `size`-square crops (progressive resizing); itself for None."""
        return self if size is None or size == self.size else replace(self, size=size)

    def box(self, height: int, width: int, generator: Optional[torch.Generator]) -> Optional[tuple[int, int, int, int]]:
        """(top, left, height, width) of the training crop in a `height` x `width` image; None in
        evaluation (the centre is taken after resizing)."""
        if not self.train:
            return None
        return random_crop_box(height, width, self.scale, self.ratio, generator)

    def reduction(self, height: int, width: int, box: Optional[tuple[int, int, int, int]]) -> int:
        """The JPEG DCT scale (1, 2, 4 or 8) that still leaves the crop at least `size` pixels wide
        and high: decoding at 1/2 scale costs about two thirds of a full decode (benchmarks)."""
        if box is not None:  # training: the crop still at least `size` on its shorter side
            short, needed = min(box[2], box[3]), self.size
        else:  # evaluation: the shorter side still at least `resize`
            short, needed = min(height, width), self.resize
        for factor in (8, 4, 2):
            if short / factor >= needed:
                return factor
        return 1

    def finish(self, image: torch.Tensor, box: Optional[tuple[int, int, int, int]]) -> torch.Tensor:
        """A decoded uint8 CHW image to its `size`-square crop, with torchvision's kernels as the pil
        path's v2 transforms call them (the same pixels). The crop is made contiguous channels-last
        first: torchvision's uint8 antialiased resize takes its vectorized path only then (0.40
        instead of 0.60 ms per 224 px crop here)."""
        batch = image.unsqueeze(0)
        if box is not None:
            top, left, height, width = box
            crop = batch[:, :, top:top + height, left:left + width].contiguous(memory_format=torch.channels_last)
            if crop.device.type == "cpu":  # v2's resize for uint8 on the CPU is this call, minus its checks
                return nn_functional.interpolate(crop, size=(self.size, self.size), mode="bilinear", antialias=True,
                                                 align_corners=False)[0]
            return F.resize(crop, [self.size, self.size], antialias=True)[0]
        resized = F.resize(batch.contiguous(memory_format=torch.channels_last), [self.resize], antialias=True)
        return F.center_crop(resized, [self.size, self.size])[0]


def random_crop_box(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
                    generator: Optional[torch.Generator]) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box, drawn from `generator` in the same order and with the same
    arithmetic as v2.RandomResizedCrop draws from the global RNG: with a generator seeded as the
    global RNG was, the box is the same."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1]),
                                                   generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = float(width) / float(height)  # the fallback: the centre, clamped to the ratio range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _scaled_box(box: Optional[tuple[int, int, int, int]], height: int, width: int,
                decoded: tuple[int, int]) -> Optional[tuple[int, int, int, int]]:
    """`box` of a `height` x `width` image in the same image decoded at `decoded` (h, w)."""
    if box is None or decoded == (height, width):
        return box
    sy, sx = decoded[0] / height, decoded[1] / width
    top, left = int(round(box[0] * sy)), int(round(box[1] * sx))
    h = max(1, min(decoded[0] - top, int(round(box[2] * sy))))
    w = max(1, min(decoded[1] - left, int(round(box[3] * sx))))
    return top, left, h, w


def _generator(seed: Optional[int]) -> Optional[torch.Generator]:
    return torch.Generator().manual_seed(seed) if seed is not None else None


# -- the fast host path --------------------------------------------------------------------------------
def decode_on_host(path: str, data: bytearray, geometry: Geometry,
                   generator: Optional[torch.Generator]) -> torch.Tensor:
    """The sample's uint8 CHW crop, decoded on this CPU; bad content is a `BadImageError`."""
    header = jpeg_header(data)
    if header is not None and header.components in (1, 3) and header.precision == 8:
        box = geometry.box(header.height, header.width, generator)
        if geometry.reduction(header.height, header.width, box) == 1:
            try:
                image = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)
            except RuntimeError as ex:  # libjpeg's errors: truncated, corrupt, unsupported
                raise BadImageError(path, CORRUPT, str(ex).rsplit(", ", 1)[-1]) from None
            return geometry.finish(image, box)
        return _decode_with_pil(path, data, geometry, box)
    return _decode_with_pil(path, data, geometry, None, generator)


def _decode_with_pil(path: str, data: bytearray, geometry: Geometry, box: Optional[tuple[int, int, int, int]],
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Any image PIL reads (every mode to 8-bit RGB, see `load_rgb`); a JPEG whose crop allows it is
    decoded at a reduced scale. `box` is drawn here from `generator` when not given."""
    drawn: dict[str, Any] = {"box": box}

    def choose(image: Image.Image) -> None:  # the size is known, the pixels not yet decoded
        width, height = image.size
        drawn["size"] = (height, width)
        if drawn["box"] is None:
            drawn["box"] = geometry.box(height, width, generator)
        factor = geometry.reduction(height, width, drawn["box"])
        if factor > 1 and image.format == "JPEG":
            image.draft("RGB", (width // factor, height // factor))

    image = load_rgb(path, data=data, before_decode=choose)
    # HWC, viewed as CHW: the channels-last layout torchvision's uint8 resize is fastest on.
    tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    height, width = drawn["size"]
    box = _scaled_box(drawn["box"], height, width, decoded=(image.height, image.width))
    return geometry.finish(tensor, box)


def augment_seeded(augment: Callable[[torch.Tensor], torch.Tensor], image: torch.Tensor,
                   generator: Optional[torch.Generator]) -> torch.Tensor:
    """`augment` (torchvision's RandAugment or TrivialAugment: they draw from torch's global
    generator) on the uint8 crop, drawing from the sample's own generator when it has one, so a
    resumed epoch augments each sample as the interrupted one did."""
    if generator is None:
        return augment(image)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
        return augment(image)


def finish_on_host(image: torch.Tensor, geometry: Geometry, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``device_normalize=false``: the flip and normalization on the host, per sample."""
    assert geometry.host_finish is not None
    hflip, mean, std = geometry.host_finish
    if geometry.train and hflip and torch.rand(1, generator=generator).item() < 0.5:
        image = image.flip(-1)
    return normalize(image.unsqueeze(0), mean, std).squeeze(0)


def host_sample(path: str, data: bytearray, geometry: Geometry, augment: Optional[Callable[[torch.Tensor], torch.Tensor]],
                seed: Optional[int]) -> torch.Tensor:
    """``data.decode=fast``'s sample: decoded and cropped, augmented and finished on the host where asked."""
    generator = _generator(seed)
    image = decode_on_host(path, data, geometry, generator)
    if augment is not None:
        image = augment_seeded(augment, image, generator)
    if geometry.host_finish is not None:
        image = finish_on_host(image, geometry, generator)
    return image


class _CroppedFiles(ImageFiles):
    """Files cropped by `geometry` from each sample's seed (the fast and device paths); `augment`: the
    fast path's policy."""

    takes_seeds = True

    def __init__(self, split: str, samples: Sequence[tuple[str, int]], classes: Sequence[str], *, policy: Policy,
                 bad_list: BadFileList, geometry: Geometry,
                 augment: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        super().__init__(split, samples, classes, None, policy, bad_list)
        self.geometry = self.full_geometry = geometry
        self.augment = augment

    def use_size(self, size: int) -> None:
        self.geometry = self.full_geometry.at(size)


class DecodedFiles(_CroppedFiles):
    """``data.decode=fast``: each sample decoded and cropped in the loader worker (`host_sample`)."""

    def load(self, index: int, seed: Optional[int]) -> torch.Tensor:
        path = self.samples[index][0]
        return host_sample(path, read_bytes(path), self.geometry, self.augment, seed)


# -- the device path -----------------------------------------------------------------------------------
@dataclass
class EncodedImage:
    """A JPEG's bytes and its crop box, as a device-path worker returns one sample."""

    data: torch.Tensor  # uint8, the file's bytes
    box: Optional[tuple[int, int, int, int]]
    index: int
    seed: Optional[int]
    #: The crop's side (progressive resizing: the epoch's; None: the split's geometry's).
    size: Optional[int] = None

    def on_host(self, path: str, geometry: Geometry) -> torch.Tensor:
        """Decoded on the host from the same seed (the same box): a JPEG the device decoder refused."""
        return decode_on_host(path, bytearray(self.data.numpy()), geometry.at(self.size), _generator(self.seed))


def device_sample(path: str, data: bytearray, index: int, seed: Optional[int],
                  geometry: Geometry) -> Union[EncodedImage, torch.Tensor]:
    """``data.decode=device``'s sample: the JPEG's bytes and crop box, or decoded here on the host
    when the device decoder is not given the file (not a JPEG, CMYK, 12-bit, cut short...)."""
    header = jpeg_header(data)
    if header is None or not header.device_decodable:
        return decode_on_host(path, data, geometry, _generator(seed))
    box = geometry.box(header.height, header.width, _generator(seed))
    return EncodedImage(torch.frombuffer(data, dtype=torch.uint8), box, index, seed, geometry.size)


class EncodedBatch:
    """A device-path batch as it leaves the loader: the JPEGs' bytes end to end in one tensor (one
    shared-memory segment per batch instead of one per image), their boxes, indices and seeds as
    plain lists, the images a worker decoded on the host stacked in one tensor, and the labels.

    Not a tensor, list or dataclass on purpose: Lightning's default transfer would copy the bytes
    to the device, where nvjpeg does not read them; the image-folder module decodes it instead."""

    def __init__(self, split: str, samples: list[tuple[Union[EncodedImage, torch.Tensor], int]]) -> None:
        self.split = split
        self.labels = torch.tensor([label for _, label in samples])
        encoded = [(i, item) for i, (item, _) in enumerate(samples) if isinstance(item, EncodedImage)]
        host = [(i, item) for i, (item, _) in enumerate(samples) if not isinstance(item, EncodedImage)]
        self.encoded_at = [i for i, _ in encoded]
        self.boxes = [item.box for _, item in encoded]
        self.indices = [item.index for _, item in encoded]
        self.seeds = [item.seed for _, item in encoded]
        #: The side every image of the batch is cropped to (progressive resizing: the epoch's).
        self.size: Optional[int] = next((item.size for _, item in encoded), None)
        if self.size is None and host:
            self.size = int(host[0][1].shape[-1])
        self.offsets = [0, *itertools.accumulate(item.data.numel() for _, item in encoded)]
        self.data = _concatenated([item.data for _, item in encoded], self.offsets[-1])
        self.host_at = [i for i, _ in host]
        self.host_images = torch.stack([item for _, item in host]) if host else None

    def __len__(self) -> int:
        return len(self.labels)

    def encoded(self) -> list[tuple[int, EncodedImage]]:
        """(position in the batch, image) of each JPEG for the device."""
        return [(at, EncodedImage(self.data[self.offsets[k]:self.offsets[k + 1]], self.boxes[k], self.indices[k],
                                  self.seeds[k], self.size)) for k, at in enumerate(self.encoded_at)]


def _concatenated(parts: list[torch.Tensor], total: int) -> torch.Tensor:
    # In a loader worker, straight into shared memory, as PyTorch's default_collate does: the
    # batch then crosses to the training process without another copy.
    if get_worker_info() is not None and parts:
        out = parts[0].new(parts[0].untyped_storage()._new_shared(total, device="cpu")).resize_(total)
        return torch.cat(parts, out=out)
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class EncodedFiles(_CroppedFiles):
    """``data.decode=device``: the worker reads the file and draws the crop box (`device_sample`)."""

    def load(self, index: int, seed: Optional[int]) -> Union[EncodedImage, torch.Tensor]:
        path = self.samples[index][0]
        return device_sample(path, read_bytes(path), index, seed, self.geometry)

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return partial(EncodedBatch, self.split)  # a partial, not a lambda: loader workers pickle it

    def on_host(self, item: EncodedImage) -> tuple[torch.Tensor, int]:
        """A file the device decoder refused: decoded on the host from the same seed (the same box);
        when the host cannot either, policy skip takes the next loadable file, as in every mode."""
        path, label = self.samples[item.index]
        try:
            return item.on_host(path, self.full_geometry), label
        except BadImageError as ex:
            self.found_bad(item.index, ex)
        if item.size is not None:
            self.use_size(item.size)
        image, label = self.first_loadable((item.index + 1) % len(self.samples), item.seed)
        if isinstance(image, EncodedImage):  # the replacement is a JPEG the device may decode: do it here
            return self.on_host(image)
        return image, label


def decode_batch(batch: EncodedBatch, files: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 NCHW images, labels) on `device`: the JPEGs decoded there in one batched call, each
    cropped and resized there; refused files and host-decoded ones put in their places. `files` is
    the split's data set: its `geometry`, and `on_host` for a JPEG the device refused. The batch's
    own size wins over the geometry's (progressive resizing changes it per epoch in the workers)."""
    geometry = files.geometry.at(batch.size)
    images = torch.empty((len(batch), 3, geometry.size, geometry.size), dtype=torch.uint8, device=device)
    labels = batch.labels.clone()
    encoded = batch.encoded()
    decoded = _decode_all([item.data for _, item in encoded], device)
    for (at, item), image in zip(encoded, decoded):
        if image is None:
            host, label = files.on_host(item)  # label None: the batch's own (no replacement sample)
            if label is not None:
                labels[at] = label
            images[at] = host.to(device, non_blocking=True)
        else:
            images[at] = geometry.finish(image, item.box)
    if batch.host_images is not None:
        images[batch.host_at] = batch.host_images.to(device, non_blocking=True)
    return images, labels.to(device, non_blocking=True)


def _decode_all(data: list[torch.Tensor], device: torch.device) -> list[Optional[torch.Tensor]]:
    """Each JPEG decoded on `device`, one batched call; if the call fails, one call per file to find
    the refused ones (None)."""
    if not data:
        return []
    try:
        return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        pass
    decoded: list[Optional[torch.Tensor]] = []
    for one in data:
        try:
            decoded.append(decode_jpeg(one, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            decoded.append(None)
    return decoded
