"""The evaluation preprocessing of training, applied to a client's image bytes, from the model card.

Each data module states it once (``inference_preprocessing``); export writes it into ``model.json``:
- ``color``: ``"L"`` or ``"RGB"``; bytes decoded by `trainer.data.badfiles.load_rgb`, training's
  loader, then made grey when the network takes one channel;
- ``resize``: an int for the shorter side (torchvision's ``Resize(int)``), ``[h, w]`` for exactly
  that; ``interpolation``: ``bilinear`` (antialiased on uint8, as in training) or ``area`` (how
  scikit-learn's 8x8 digits were made from 32x32 bitmaps); ``center_crop``: ``[h, w]`` or null;
- ``scale``, ``mean``, ``std``: ``(pixels * scale - mean) / std``, per batch by `Normalizer`.

`pixels` stops at uint8 (what travels to the inference worker: a quarter of the float bytes). Its
`max_pixels` is checked on the header, before anything is decoded: a small file can declare a huge
image (a 140 KB PNG of 12000 x 12000 takes seconds and 144 MB to decode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from PIL import Image

# torchvision and trainer.data.badfiles are imported where `pixels` needs them: the server's inference
# worker imports this module for `Normalizer` alone, and they would cost it memory (docs/deploy.md,
# "Processes and memory").

INTERPOLATIONS = ("bilinear", "area")


class NotAnImage(ValueError):
    """The bytes are not an image this preprocessing can use; `str()` is the one-line reason."""


class TooManyPixels(ValueError):
    """The image's header declares more pixels than allowed; refused before decoding. `str()` is the
    one-line reason, naming the image's size and the limit."""

    def __init__(self, width: int | None, height: int | None, limit: int | None, detail: str = "") -> None:
        if width is not None and height is not None and limit is not None:
            text = (f"image of {width:,} x {height:,} = {width * height:,} pixels is over the limit of "
                    f"{limit:,} pixels")
        else:  # PIL's own check refused it in Image.open; its message names the size and its limit
            text = f"image is over PIL's decompression-bomb limit: {detail.rstrip('.')}"
        super().__init__(text)


@dataclass(frozen=True)
class Preprocessing:
    color: str
    resize: int | tuple[int, int]
    interpolation: str
    center_crop: Optional[tuple[int, int]]
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_card(cls, card: Mapping[str, Any], where: str = "model.json") -> "Preprocessing":
        """From the card's ``preprocessing``; a ValueError naming the key when it is not usable."""
        try:
            resize = card["resize"]
            crop = card.get("center_crop")
            made = cls(color=str(card["color"]), resize=int(resize) if isinstance(resize, int) else _pair(resize),
                       interpolation=str(card.get("interpolation", "bilinear")),
                       center_crop=None if crop is None else _pair(crop), scale=float(card["scale"]),
                       mean=tuple(float(m) for m in card["mean"]), std=tuple(float(s) for s in card["std"]))
        except (KeyError, TypeError, ValueError) as ex:
            raise ValueError(f"{where}: preprocessing is incomplete or malformed ({type(ex).__name__}: {ex}); "
                             "export the run again with this version") from None
        if made.color not in ("L", "RGB") or made.interpolation not in INTERPOLATIONS:
            raise ValueError(f"{where}: preprocessing color '{made.color}' / interpolation '{made.interpolation}' "
                             f"is not one of L, RGB / {', '.join(INTERPOLATIONS)}")
        if len(made.mean) != made.channels or len(made.std) != made.channels:
            raise ValueError(f"{where}: preprocessing mean/std have {len(made.mean)}/{len(made.std)} values for "
                             f"{made.channels} channel(s)")
        return made

    @property
    def channels(self) -> int:
        return 1 if self.color == "L" else 3

    @property
    def output_size(self) -> tuple[int, int]:
        if self.center_crop is not None:
            return self.center_crop
        if isinstance(self.resize, int):
            raise ValueError("a shorter-side resize without a center crop has no fixed output size")
        return self.resize

    def pixels(self, data: bytes, name: str = "request", max_pixels: Optional[int] = None) -> np.ndarray:
        """uint8 (C, H, W) as the network's evaluation input before scaling; NotAnImage when `data`
        is not a whole image PIL can decode, TooManyPixels (before decoding) when its header declares
        more than `max_pixels` pixels or more than PIL's own limit (``Image.MAX_IMAGE_PIXELS``)."""
        from torchvision.transforms import v2

        from trainer.data.badfiles import TOO_LARGE, BadImageError, load_rgb

        def check_size(image: Image.Image) -> None:  # the header is read, nothing decoded yet
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise TooManyPixels(width, height, max_pixels)

        try:
            image = load_rgb(name, data=data, before_decode=check_size)
        except BadImageError as ex:
            if ex.reason == TOO_LARGE:  # PIL's DecompressionBombError (Image.open's own header check)
                raise TooManyPixels(None, None, None, ex.detail) from None
            detail = "PIL cannot identify it" if "cannot identify image file" in ex.detail else ex.detail
            raise NotAnImage(f"not a usable image: {ex.reason} ({detail})") from None
        if self.color == "L":
            image = image.convert("L")  # R=G=B stays exact: PIL's luma weights sum to one
        tensor = self._resized(v2.functional.pil_to_tensor(image))
        if self.center_crop is not None:
            tensor = v2.functional.center_crop(tensor, list(self.center_crop))
        return tensor.numpy()

    def _resized(self, tensor: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms import v2

        if self.interpolation == "bilinear":
            sizes = [self.resize] if isinstance(self.resize, int) else list(self.resize)
            return v2.functional.resize(tensor, sizes, interpolation=v2.InterpolationMode.BILINEAR, antialias=True)
        size = _shorter_side(tensor.shape[-2:], self.resize) if isinstance(self.resize, int) else self.resize
        if tuple(tensor.shape[-2:]) == tuple(size):
            return tensor
        area = F.interpolate(tensor[None].float(), size=size, mode="area")[0]
        return area.round_().clamp_(0, 255).to(torch.uint8)


class Normalizer:
    """uint8 (N, C, H, W) batches to the network's float32 input, on `device`."""

    def __init__(self, preprocessing: Preprocessing, device: torch.device | str = "cpu") -> None:
        shape = (1, preprocessing.channels, 1, 1)
        std = torch.tensor(preprocessing.std).view(shape)
        self.device = torch.device(device)
        self.multiplier = (preprocessing.scale / std).to(self.device)
        self.offset = (torch.tensor(preprocessing.mean).view(shape) / std).to(self.device)

    def __call__(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        batch = torch.as_tensor(pixels).to(self.device, non_blocking=True).float()
        return batch.mul_(self.multiplier).sub_(self.offset)


def _pair(value: Sequence[Any]) -> tuple[int, int]:
    if isinstance(value, (str, bytes)) or len(value) != 2:
        raise ValueError(f"expected [height, width], got {value!r}")
    return int(value[0]), int(value[1])


def _shorter_side(size: Sequence[int], shorter: int) -> tuple[int, int]:
    h, w = size
    if h <= w:
        return shorter, max(1, int(shorter * w / h))
    return max(1, int(shorter * h / w)), shorter
