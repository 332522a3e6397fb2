"""One image as `prepare` writes it (trainer/data/prepare.py for a folder, prepare_shards.py for
shards): resized when its longer side exceeds the limit, else its bytes as they are."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from PIL import Image

from trainer.data.badfiles import CORRUPT, UNSUPPORTED, BadFile, BadImageError, check_file, to_rgb
from trainer.infra.errors import first_line

RESIZED, COPIED = "resized", "copied"
# PIL first shrinks by a whole factor with a box filter, then resamples: much faster on large
# images, and at 3 indistinguishable from a plain antialiased resize.
REDUCING_GAP = 3.0


def image_bytes(split: str, src: str, max_side: int | None, quality: int) -> tuple[str, bytes] | BadFile:
    """(RESIZED or COPIED, the image's bytes): resized when its longer side exceeds `max_side`
    (None: never), else the file's bytes as they are; a `BadFile` when training could not read it."""
    problem = check_file(src, decode=False)  # cheap first: non-images, empty files, wrong content
    if problem is not None:
        return BadFile(split, src, *problem)
    try:
        with Image.open(src) as image:
            target = _target_size(image.size, max_side) if max_side is not None else None
            if target is None:
                # The full decode training does: a small truncated JPEG has a valid header too.
                problem = check_file(src, decode=True)
                if problem is not None:
                    return BadFile(split, src, *problem)
                return COPIED, Path(src).read_bytes()
            fmt = _format(src)  # by extension, so name and content agree (a PNG named .jpg becomes a JPEG)
            return RESIZED, _encoded(_resized(src, image, target, fmt), fmt, quality)
    except BadImageError as ex:
        return BadFile(split, src, ex.reason, ex.detail)


def _target_size(size: tuple[int, int], max_side: int) -> tuple[int, int] | None:
    """The size with the longer side `max_side`, aspect kept; None when already that small."""
    width, height = size
    longer = max(width, height)
    if longer <= max_side:
        return None
    return max(1, round(width * max_side / longer)), max(1, round(height * max_side / longer))


def _format(path: str) -> str:
    return Image.registered_extensions()[os.path.splitext(path)[1].lower()]


def _resized(path: str, image: Image.Image, target: tuple[int, int], fmt: str) -> Image.Image:
    # JPEG: libjpeg decodes at 1/2, 1/4 or 1/8 scale, never below `target`; other formats ignore it.
    image.draft("RGB", target)
    try:
        image.load()
    except Exception as ex:  # noqa: BLE001 - PIL's decoders raise OSError, SyntaxError, ValueError ...
        raise BadImageError(path, CORRUPT, first_line(ex) or type(ex).__name__) from None
    try:
        return _resamplable(image, fmt).resize(target, Image.Resampling.BILINEAR, reducing_gap=REDUCING_GAP)
    except (ValueError, OSError, TypeError) as ex:
        raise BadImageError(path, UNSUPPORTED, f"mode {image.mode}: {ex}") from None


def _resamplable(image: Image.Image, fmt: str) -> Image.Image:
    # JPEG stores 8-bit grey and RGB as training reads them; CMYK, alpha and 16-bit become what
    # training would make of them. Palette indices and bits cannot be interpolated (PIL would fall
    # back to nearest neighbour), so those go to RGB for every format.
    if (fmt == "JPEG" and image.mode not in ("RGB", "L")) or image.mode in ("P", "PA", "1"):
        return to_rgb(image)
    return image


def _encoded(image: Image.Image, fmt: str, quality: int) -> bytes:
    options: dict[str, Any] = {"quality": quality} if fmt == "JPEG" else {}
    try:
        return _save(image, fmt, options)
    except (OSError, ValueError, KeyError, TypeError):  # the format cannot store the mode (WebP and I;16, ...)
        return _save(to_rgb(image), fmt, options)


def _save(image: Image.Image, fmt: str, options: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()  # in memory: resized images are small, and the file is then written in one go
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()
