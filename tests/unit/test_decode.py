"""data.decode: the pil, fast and device paths give the same samples, the same crop distribution,
the same order and the same bad-file policy; the device path decodes batches on the CPU here."""

import io
import math

import pytest
import torch
from PIL import Image
from scipy.stats import ks_2samp
from torchvision.transforms import v2

from tests.helpers import write_photo_jpegs
from trainer.data.badfiles import CORRUPT, BadImageError, read_list
from trainer.data.decode import EncodedBatch, EncodedImage, Geometry, jpeg_header, random_crop_box
from trainer.data.imagefolder import ImageFolderDataModule
from trainer.data.resumable import SeededSamples, mix
from trainer.infra.errors import UserError

MODES = ("pil", "fast", "device")
CPU = torch.device("cpu")


def _jpeg(image: Image.Image, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **save)
    return buffer.getvalue()


def _module(root, decode, **kwargs):
    options = dict(image_size=64, eval_crop_fraction=0.75, batch_size=4, num_workers=0, decode=decode)
    options.update(kwargs)
    dm = ImageFolderDataModule(root=str(root), **options)
    dm.inspect()
    dm.apply_loader(dm.loader_settings(cuda=False))
    dm.setup()
    return dm


def _batches(dm, loader, count=None):
    """Batches as the training step receives them before flip/normalize: (uint8 images, labels)."""
    out = []
    for i, batch in enumerate(loader):
        if count is not None and i == count:
            break
        out.append(dm.transfer_batch_to_device(batch, CPU, 0))
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    write_photo_jpegs(root, {"train": 8, "val": 3}, classes=2, size=(160, 120))
    return root


# -- the JPEG header ------------------------------------------------------------------------------------
def test_jpeg_header_reads_size_components_and_completeness():
    """Size and components as PIL reads them; a file cut short is not complete; CMYK and a cut file
    are not given to the device decoder; a PNG is not a JPEG."""
    rgb = Image.new("RGB", (70, 30), (10, 200, 30))
    header = jpeg_header(_jpeg(rgb, quality=90))
    assert (header.height, header.width, header.components, header.complete) == (30, 70, 3, True)
    assert header.device_decodable
    assert jpeg_header(_jpeg(rgb.convert("L"))).components == 1
    progressive = jpeg_header(_jpeg(rgb, progressive=True))
    assert progressive.frame == 0xC2 and progressive.device_decodable
    cmyk = jpeg_header(_jpeg(rgb.convert("CMYK")))
    assert cmyk.components == 4 and not cmyk.device_decodable
    data = _jpeg(Image.effect_noise((64, 64), 40).convert("RGB"), quality=95)
    cut = jpeg_header(data[: len(data) // 2])
    assert cut is not None and not cut.complete and not cut.device_decodable
    assert jpeg_header(data + b"\x00" * 10).complete  # padding after the end marker is allowed
    png = io.BytesIO()
    rgb.save(png, "PNG")
    assert jpeg_header(png.getvalue()) is None
    assert jpeg_header(b"\xff\xd8\xff") is None


# -- the crop boxes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("height,width", [(120, 160), (375, 500), (500, 40), (30, 900)])
def test_crop_box_is_torchvisions_for_the_same_seed(height, width):
    """random_crop_box draws what v2.RandomResizedCrop draws from a global RNG seeded the same way,
    the fallback to the centre included (very long images)."""
    crop = v2.RandomResizedCrop(32, antialias=True)
    image = torch.zeros(3, height, width, dtype=torch.uint8)
    for seed in range(200):
        torch.manual_seed(seed)
        params = crop.make_params([image])
        expected = (params["top"], params["left"], params["height"], params["width"])
        assert random_crop_box(height, width, (0.08, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(seed)) == expected


def test_crop_distribution_is_the_same_in_every_mode(photos):
    """Statistical test: the crops' area shares and aspect ratios drawn by the fast and device workers
    (seeds 10000-11999) and by torchvision's transform under the pil path's global seeding (seeds
    0-1999) are alike by a two-sample Kolmogorov-Smirnov test, and inside the configured ranges."""
    height, width = 375, 500
    crop = v2.RandomResizedCrop(32, scale=(0.2, 0.9), antialias=True)
    image = torch.zeros(3, height, width, dtype=torch.uint8)
    reference = []
    for seed in range(2000):
        torch.manual_seed(mix(seed, 1))
        p = crop.make_params([image])
        reference.append((p["height"], p["width"]))
    geometry = Geometry(32, train=True, scale=(0.2, 0.9))
    ours = [geometry.box(height, width, torch.Generator().manual_seed(mix(seed, 1)))[2:]
            for seed in range(10000, 12000)]
    for pick in (lambda h, w: h * w / (height * width), lambda h, w: math.log(w / h)):
        a, b = [pick(*hw) for hw in reference], [pick(*hw) for hw in ours]
        assert ks_2samp(a, b).pvalue > 0.001
    shares = [h * w / (height * width) for h, w in ours]
    assert 0.19 <= min(shares) and max(shares) <= 0.91
    assert all(3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02 for h, w in ours)


def test_device_workers_draw_the_boxes_the_fast_path_crops(photos):
    """The device path's worker box for (index, seed) is the fast path's box for the same sample."""
    dm = _module(photos, "device")
    for index in range(6):
        item, _ = dm.train_set[(index, 777 + index)]
        assert isinstance(item, EncodedImage)
        header = jpeg_header(item.data.numpy().tobytes())
        expected = random_crop_box(header.height, header.width, (0.08, 1.0), (3 / 4, 4 / 3),
                                   torch.Generator().manual_seed(777 + index))
        assert item.box == expected


# -- the same samples -------------------------------------------------------------------------------------
def test_every_mode_gives_the_pil_paths_pixels(photos):
    """Training crops (same sample seeds) and evaluation images are equal, pixel for pixel, in the pil,
    fast and device modes: JPEGs decode to the same pixels with torchvision and PIL, and the crop and
    resize are the same kernels. (At 64 px no crop of these 160x120 photos is twice the output, so
    none is decoded at a reduced scale.)"""
    modules = {mode: _module(photos, mode, image_size=64) for mode in MODES}
    train = {mode: _batches(dm, dm.train_dataloader(), 2) for mode, dm in modules.items()}
    val = {mode: _batches(dm, dm.val_dataloader()) for mode, dm in modules.items()}
    for mode in ("fast", "device"):
        for batches in (train, val):
            for (x, y), (x_ref, y_ref) in zip(batches[mode], batches["pil"]):
                assert torch.equal(y, y_ref)
                assert x.dtype == torch.uint8 and torch.equal(x, x_ref), mode


def test_reduced_scale_decoding_stays_within_tolerance_of_pil(tmp_path):
    """Crops at least twice the output size are decoded at 1/2..1/8 scale (libjpeg's DCT scaling
    filters differently from an antialiased bilinear resize): the stated tolerance against the pil
    path's full decode is a mean difference of at most 10 grey levels (of 255) for training crops
    and 5 for evaluation images (measured: 2-8 and 1-4 at 32-112 px)."""
    write_photo_jpegs(tmp_path, {"train": 4, "val": 2}, classes=2, size=(480, 360))
    options = dict(image_size=32, train_crop_scale=[0.5, 1.0])
    pil, fast = _module(tmp_path, "pil", **options), _module(tmp_path, "fast", **options)
    assert fast.train_set.geometry.reduction(360, 480, None) == 8  # evaluation: 360 / 8 >= 43 (32 / 0.75)
    for index in range(len(pil.train_set)):
        a = SeededSamples(pil.train_set)[(index, 5 + index)][0].float()
        b = SeededSamples(fast.train_set)[(index, 5 + index)][0].float()
        assert (a - b).abs().mean() <= 10.0
    for index in range(len(pil.val_set)):
        assert (pil.val_set[index][0].float() - fast.val_set[index][0].float()).abs().mean() <= 5.0


def test_order_and_seeds_do_not_depend_on_workers_or_mode(photos):
    """A resumed epoch carries on with the same samples in every mode, with or without workers: the
    sampler's order and the per-sample seeds are those of the pil path."""
    def after_restore(mode, workers):
        dm = _module(photos, mode, num_workers=workers, persistent_workers=False)
        dm.load_state_dict({"train_position": {"epoch": 1, "batches": 1, "items": 4, "items_per_batch": 4,
                                               "replicas": 1, "size": len(dm.train_set)}})
        return _batches(dm, dm.train_dataloader(), 2)

    reference = after_restore("pil", 0)
    for mode, workers in (("fast", 0), ("fast", 2), ("device", 2)):
        for (x, y), (x_ref, y_ref) in zip(after_restore(mode, workers), reference):
            assert torch.equal(y, y_ref) and torch.equal(x, x_ref), (mode, workers)


def test_host_finishing_in_the_fast_path_normalizes_like_the_pil_path(photos):
    """data.device_normalize=false: the fast path flips and normalizes per sample on the host; the
    evaluation images equal the pil path's."""
    pil = _module(photos, "pil", device_normalize=False)
    fast = _module(photos, "fast", device_normalize=False)
    x_ref, _ = pil.val_set[0]
    x, _ = fast.val_set[0]
    assert x.dtype == torch.float32 and torch.allclose(x, x_ref, atol=1e-6)
    flipped = {bool(torch.equal(SeededSamples(fast.train_set)[(0, s)][0], SeededSamples(fast.train_set)[(0, s)][0]))
               for s in range(4)}
    assert flipped == {True}  # the same seed, the same sample


# -- bad files ------------------------------------------------------------------------------------------------
def _undefined_quant_table(path):
    """A JPEG whose header and end marker look right but whose decoder stops: component 1 names a
    quantization table that is not there (libjpeg: 'Quantization table 0x03 was not defined')."""
    data = bytearray(path.read_bytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 12] = 3
    path.write_bytes(bytes(data))


@pytest.fixture
def damaged(tmp_path):
    write_photo_jpegs(tmp_path, {"train": 5, "val": 2}, classes=2, size=(96, 72))
    files = sorted((tmp_path / "train").rglob("*.jpg"))
    truncated, undecodable = files[1], files[6]
    truncated.write_bytes(truncated.read_bytes()[:900])
    _undefined_quant_table(undecodable)
    return tmp_path, truncated, undecodable


@pytest.mark.parametrize("mode", MODES)
def test_bad_files_are_skipped_and_listed_in_every_mode(damaged, mode, tmp_path_factory):
    """Policy skip: a truncated JPEG (the device path's worker sees its end marker missing and the host
    refuses it) and a JPEG the decoder refuses (in the device path found by the batched decode) are
    listed, and each is replaced by the next file of the split with its label, as in the pil path."""
    root, truncated, undecodable = damaged
    dm = _module(root, mode, max_bad_share=0.5, eval_crop_fraction=1.0, batch_size=10, train_crop_scale=[1.0, 1.0])
    dm._bad_list.attach(tmp_path_factory.mktemp("run"))
    dataset = dm.train_set
    loader = torch.utils.data.DataLoader(SeededSamples(dataset), batch_size=10, collate_fn=dataset.collate_fn(),
                                         sampler=[(i, 3) for i in range(10)])
    [(images, labels)] = _batches(dm, loader)
    listed = {r.path: r.reason for r in read_list(dm._bad_list.path)}
    assert listed == {str(truncated): CORRUPT, str(undecodable): CORRUPT}
    paths = [p for p, _ in dataset.samples]
    for bad in (truncated, undecodable):
        at = paths.index(str(bad))
        assert labels[at] == dataset.samples[at + 1][1]
        assert torch.equal(images[at], images[at + 1])  # the next file, with the same full-image crop


@pytest.mark.parametrize("mode", MODES)
def test_error_policy_stops_at_the_bad_file_in_every_mode(damaged, mode):
    """Policy error: the first unreadable file ends the run with one line naming it."""
    root, truncated, _ = damaged
    dm = _module(root, mode, bad_files="error", image_size=32, batch_size=10)
    with pytest.raises(BadImageError) as raised:
        _batches(dm, dm.train_dataloader())
    assert str(truncated) in str(raised.value) or "Quantization" in str(raised.value) or CORRUPT in str(raised.value)


def test_the_device_path_decodes_cmyk_and_png_on_the_host(tmp_path):
    """Files the device decoder is not given (CMYK JPEG, PNG) come decoded from the worker and land in
    their places in the batch, equal to the pil path's pixels."""
    write_photo_jpegs(tmp_path, {"train": 2, "val": 1}, classes=2, size=(96, 72))
    first = sorted((tmp_path / "val").rglob("*.jpg"))
    Image.open(first[0]).convert("CMYK").save(first[0], "JPEG", quality=90)
    Image.open(first[1]).save(first[1].with_suffix(".png"))
    first[1].unlink()
    device, pil = _module(tmp_path, "device"), _module(tmp_path, "pil")
    batch = next(iter(device.val_dataloader()))
    assert isinstance(batch, EncodedBatch) and batch.host_images is not None
    (x, y), (x_ref, y_ref) = _batches(device, [batch])[0], _batches(pil, pil.val_dataloader(), 1)[0]
    assert torch.equal(y, y_ref) and torch.equal(x, x_ref)


# -- choosing the mode --------------------------------------------------------------------------------------
def test_auto_is_the_host_decode_and_says_whether_device_could_decode(photos, tmp_path):
    """auto: fast, on CUDA too (device measured 0.62x of it on an H200); the line says why, and
    whether data.decode=device could decode these files instead; device stays a choice."""
    dm = ImageFolderDataModule(root=str(photos), decode="auto")
    dm.inspect()
    mode, how = dm.resolve_decode(cuda=True)
    assert mode == "fast" and "0.62x" in how and "100% of the files are JPEGs: data.decode=device" in how
    mode, how = dm.resolve_decode(cuda=False)
    assert mode == "fast" and "no CUDA" in how
    device = ImageFolderDataModule(root=str(photos), decode="device")
    device.inspect()
    assert device.resolve_decode(cuda=True) == ("device", "device (as configured)")
    host_finishing = ImageFolderDataModule(root=str(photos), decode="auto", device_normalize=False)
    host_finishing.inspect()
    mode, how = host_finishing.resolve_decode(cuda=True)
    assert mode == "fast" and "data.device_normalize=false" in how
    for path in list(photos.rglob("*.jpg")):
        target = tmp_path / path.relative_to(photos).with_suffix(".png")
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.open(path).save(target)
    pngs = ImageFolderDataModule(root=str(tmp_path), decode="auto")
    pngs.inspect()
    mode, how = pngs.resolve_decode(cuda=True)
    assert mode == "fast" and "0% of the files are JPEGs" in how


def test_decode_settings_that_cannot_work_are_one_line():
    """An unknown mode, and device decoding with host finishing, are refused naming data.decode."""
    with pytest.raises(UserError, match=r"data.decode: 'gpu' is not a decode mode; allowed: auto, pil, fast, device"):
        ImageFolderDataModule(root="x", decode="gpu")
    with pytest.raises(UserError, match="data.decode: device .* data.device_normalize=false"):
        ImageFolderDataModule(root="x", decode="device", device_normalize=False)
