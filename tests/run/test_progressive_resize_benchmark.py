"""benchmarks/progressive_resize.py at its smallest (--quick), as CI runs it: every size of the default
224 px schedule gets a row with the loader's rates (fast and pil), the step's and their speed-ups,
the schedule's expected-time line follows, and the loader really delivers each size."""

from __future__ import annotations

import re

import pytest

from tests.helpers import benchmark

NUMBER = r"[\d,]+(?:\.\d+)?"


@pytest.mark.run
def test_the_quick_run_has_a_row_per_size_with_numbers(tmp_path):
    module = benchmark("progressive_resize")
    sizes = module.sizes_of(module.default_schedule())
    assert sizes == [128, 160, 192, 224]  # the documented default; the benchmark derives them itself
    out = tmp_path / "progressive_resize.md"
    module.main(["--quick", "--folder", str(tmp_path / "photos"), "--out", str(out)])
    text = out.read_text()
    rate = rf"({NUMBER}) \({NUMBER}-{NUMBER}\) \| ({NUMBER})x"
    for size in sizes:
        row = re.search(rf"^\| {size} \| ([\d.]+) \| (\d+) \| {rate} \| {rate} \| {rate} \|$", text, re.MULTILINE)
        assert row, (size, text)
        assert float(row.group(1)) == pytest.approx((size / 224) ** 2, abs=0.005)
        assert all(float(g.replace(",", "")) > 0 for g in row.groups()[2:]), row.group(0)
    assert re.search(rf"^\| 224 \| 1\.00 \| 3 \| {NUMBER} .*\| 1\.00x \|$", text, re.MULTILINE)
    assert re.search(r"expected time of 16 epochs against all at 224 px: [\d.]+x with data.decode=fast, "
                     r"[\d.]+x with data.decode=pil", text)
    assert "`python benchmarks/progressive_resize.py --quick" in text


@pytest.mark.run
def test_the_loader_delivers_each_epochs_size(tmp_path):
    """The sampler's epoch picks the crop side: what the benchmark's loader rates are rates of."""
    module = benchmark("progressive_resize")
    schedule = module.default_schedule()
    loader = module.resized_loader(module.make_folder(tmp_path, 32), "fast", schedule, batch=4)
    for size in module.sizes_of(schedule):
        loader.sampler.set_epoch(module.epoch_at(schedule, size))
        images, _ = next(iter(loader))
        assert tuple(images.shape) == (4, 3, size, size)
