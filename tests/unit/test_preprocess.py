"""The serving preprocessing (trainer/deploy/preprocess.py), built from the model card alone, gives the
network the input training evaluated on: pixel for pixel for image folders, within the rounding of an
8-bit file for the digits; a card it cannot follow and bytes that are not an image are one line."""

import io
from queue import Empty, Queue

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import write_photo_jpegs
from trainer.data.digits import DigitsDataModule
from trainer.data.imagefolder import ImageFolderDataModule
from trainer.deploy.preprocess import NotAnImage, Normalizer, Preprocessing


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_digit_png_becomes_the_tensor_training_evaluated():
    """A test digit saved as an 8-bit PNG, at 8x8 and enlarged 4x, gives the data module's normalized
    tensor within half a grey level (the 0..16 values are not all whole 8-bit levels)."""
    dm = DigitsDataModule()
    dm.setup()
    preprocessing = Preprocessing.from_card(dm.inference_preprocessing())
    normalize = Normalizer(preprocessing)
    mean, std = dm._standardized
    bound = 0.5 / 255 / std + 1e-6
    for index in range(0, len(dm.test_set), 37):
        expected, _ = dm.test_set[index]
        grey = ((expected[0].numpy() * std + mean) * 255).round().clip(0, 255).astype(np.uint8)
        for picture in (Image.fromarray(grey), Image.fromarray(grey).resize((32, 32), Image.NEAREST)):
            buffer = io.BytesIO()
            picture.save(buffer, "PNG")
            pixels = preprocessing.pixels(buffer.getvalue())
            assert pixels.shape == (1, 8, 8) and pixels.dtype == np.uint8
            got = normalize(pixels[None])[0]
            assert (got - expected).abs().max() <= bound


def test_an_image_folder_file_becomes_the_evaluation_crop_pixel_for_pixel(tmp_path):
    """The card's resize (shorter side), bilinear antialiased, and centre crop equal the data module's
    evaluation transform (pil decode, uint8 out of the loader) on real JPEG photos, landscape and portrait."""
    write_photo_jpegs(tmp_path, {"train": 2, "val": 3}, classes=2, size=(150, 100))
    dm = ImageFolderDataModule(root=str(tmp_path), image_size=48, eval_crop_fraction=0.75, batch_size=2,
                               num_workers=0, decode="pil")
    dm.inspect()
    dm.apply_loader(dm.loader_settings(cuda=False))
    dm.setup()
    preprocessing = Preprocessing.from_card(dm.inference_preprocessing())
    assert preprocessing.output_size == (48, 48)
    for index, (path, _) in enumerate(dm.val_set.samples):
        expected, _ = dm.val_set[index]
        with open(path, "rb") as f:
            got = preprocessing.pixels(f.read())
        assert got.shape == tuple(expected.shape) and np.array_equal(got, expected.numpy())


def test_normalizer_scales_and_standardizes_per_channel():
    preprocessing = Preprocessing("RGB", (2, 2), "bilinear", None, 1 / 255, (0.5, 0.25, 0.0), (0.5, 0.25, 1.0))
    pixels = np.full((1, 3, 2, 2), 255, np.uint8)
    out = Normalizer(preprocessing)(pixels)
    assert out.dtype == torch.float32 and torch.allclose(out[0, :, 0, 0], torch.tensor([1.0, 3.0, 1.0]))


@pytest.mark.parametrize("card,says", [
    ({"color": "L", "scale": 1 / 255, "mean": [0.0], "std": [1.0]}, "KeyError"),
    ({"color": "CMYK", "resize": [8, 8], "scale": 1, "mean": [0], "std": [1]}, "not one of L, RGB"),
    ({"color": "RGB", "resize": [8, 8], "scale": 1, "mean": [0], "std": [1]}, "1/1 values for 3 channel(s)"),
    ({"color": "L", "resize": "8x8", "scale": 1, "mean": [0], "std": [1]}, "expected [height, width]"),
])
def test_a_card_that_cannot_be_followed_is_refused_naming_it(card, says):
    with pytest.raises(ValueError, match="model.json") as caught:
        Preprocessing.from_card(card)
    assert says in str(caught.value)


@pytest.mark.parametrize("data,says", [
    (b"hello, not an image", "PIL cannot identify it"),
    (b"", "empty"),
    ("truncated", "truncated"),
])
def test_bytes_that_are_not_a_whole_image_are_one_line(data, says):
    if data == "truncated":
        whole = _png(np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8))
        data = whole[: len(whole) // 2]
    preprocessing = Preprocessing("L", (8, 8), "area", None, 1 / 255, (0.0,), (1.0,))
    with pytest.raises(NotAnImage) as caught:
        preprocessing.pixels(data)
    assert says in str(caught.value) and "\n" not in str(caught.value)


class _Api:
    max_batch_size = 3
    batch_timeout = 0.05
    request_timeout = 30.0


def test_the_batch_loop_takes_what_is_queued_up_to_the_maximum_and_waits_for_nothing_else():
    """WaitingBatchLoop: a full batch from a backlog without waiting; a short batch once the timeout
    after its first request passes; nothing (after its one-second wait) from an empty queue; the
    sentinel stops the loop; a request that waited past the request timeout is answered 504."""
    from litserve.loops.base import _SENTINEL_VALUE, _StopLoopError

    from trainer.deploy.serve import WaitingBatchLoop

    loop = WaitingBatchLoop()
    queue: Queue = Queue()
    for uid in range(5):
        queue.put((0, uid, float("inf"), {"uid": uid}))  # queued "in the future": never timed out
    batch, late = loop.get_batch_requests(_Api(), queue, None)
    assert [uid for _, uid, _ in batch] == [0, 1, 2] and not late
    batch, _ = loop.get_batch_requests(_Api(), queue, None)
    assert [uid for _, uid, _ in batch] == [3, 4]  # the timeout ended it
    assert loop.get_batch_requests(_Api(), queue, None) == ([], [])
    queue.put((0, 9, 0.0, {}))  # queued at monotonic time 0: long past the request timeout
    assert loop.get_batch_requests(_Api(), queue, None) == ([], [(0, 9)])
    queue.put(_SENTINEL_VALUE)
    with pytest.raises(_StopLoopError):
        loop.get_batch_requests(_Api(), queue, None)
    with pytest.raises(Empty):
        queue.get_nowait()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height greyscale pixels, with one tiny IDAT: enough for
    PIL's Image.open (which reads the header only), nothing a decoder could finish."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns from 89 MP; ours refuses
def test_an_image_over_the_pixel_budget_is_refused_from_its_header_naming_its_size_and_the_limit():
    """`max_pixels` is checked before decoding: the refusal is immediate whatever the image would cost,
    and its one line names the declared size and the limit; at the limit it is decoded as usual."""
    import time

    from trainer.deploy.preprocess import TooManyPixels

    preprocessing = Preprocessing("L", (8, 8), "area", None, 1 / 255, (0.0,), (1.0,))
    started = time.perf_counter()
    with pytest.raises(TooManyPixels) as caught:
        preprocessing.pixels(_png_header(12000, 12000), max_pixels=40_000_000)
    assert time.perf_counter() - started < 0.5
    assert str(caught.value) == "image of 12,000 x 12,000 = 144,000,000 pixels is over the limit of 40,000,000 pixels"
    with pytest.raises(TooManyPixels, match="over the limit of 99 pixels"):
        preprocessing.pixels(_png(np.zeros((10, 10), np.uint8)), max_pixels=99)
    assert preprocessing.pixels(_png(np.zeros((10, 10), np.uint8)), max_pixels=100).shape == (1, 8, 8)


def test_pils_own_decompression_bomb_error_is_a_one_line_refusal_too():
    """Without a budget, PIL's check (Image.open, above twice Image.MAX_IMAGE_PIXELS) still refuses
    before decoding, as TooManyPixels rather than a crash or a generic 'not an image'."""
    from trainer.deploy.preprocess import TooManyPixels

    preprocessing = Preprocessing("L", (8, 8), "area", None, 1 / 255, (0.0,), (1.0,))
    with pytest.raises(TooManyPixels) as caught:
        preprocessing.pixels(_png_header(20000, 10000))
    assert "decompression-bomb limit" in str(caught.value) and "200000000 pixels" in str(caught.value)
    assert "\n" not in str(caught.value)
