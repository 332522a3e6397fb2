"""The dimension-alignment report: batch sizes and layer widths (conv, grouped conv, linear) that
are not multiples of 8, each named as the output of one layer and the input of the next, the
batch size first and rounded up; depthwise and uninitialised lazy layers skipped; a warning on
CUDA only."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from trainer.measure.alignment import Misalignment, alignment_report, format_report, report_applies
from trainer.models.resnet import build_resnet
from trainer.models.small_cnn import SmallCNN


def summary(items: list[Misalignment]) -> list[tuple[str, str, int, int, bool]]:
    return [(m.where, m.what, m.value, m.suggestion, m.fixed_by_data) for m in items]


def test_aligned_model_reports_only_what_the_data_fixes():
    items = alignment_report(SmallCNN(10, 1, widths=(32, 64, 128)), batch_size=64)
    assert summary(items) == [
        ("features.0.0", "in_channels", 1, 8, True),
        ("head.3", "out_features", 10, 16, True),
    ]
    assert "set by the data: 1 input channel;" in items[0].note
    assert "10 classes" in items[1].note and "16" in items[1].note
    assert all(m.layer in ("Conv2d", "Linear") for m in items)


def test_odd_width_is_reported_as_output_of_one_conv_and_input_of_the_next():
    items = [m for m in alignment_report(SmallCNN(10, 3, widths=(30, 64)), 64) if not m.fixed_by_data]
    assert summary(items) == [
        ("features.0.0", "out_channels", 30, 32, False),
        ("features.1.0", "in_channels", 30, 32, False),
        ("features.1.0", "out_channels", 30, 32, False),
        ("features.3.0", "in_channels", 30, 32, False),
    ]


def test_batch_size_comes_first_and_is_rounded_up():
    items = alignment_report(SmallCNN(10, 8, widths=(32,)), batch_size=50)
    assert items[0] == Misalignment("batch", "batch_size", 50, 56, items[0].note)
    assert "per device" in items[0].note
    assert alignment_report(SmallCNN(10, 8, widths=(32,)), batch_size=48, multiple=8)[0].where != "batch"
    # A different alignment (e.g. 16 for int8 kernels) changes the rounding.
    assert alignment_report(nn.Linear(16, 16), batch_size=50, multiple=16)[0].suggestion == 64


def test_grouped_convs_need_every_group_aligned_and_depthwise_is_skipped():
    model = nn.Sequential(
        nn.Conv2d(8, 64, 1),                  # aligned
        nn.Conv2d(64, 64, 3, groups=2),       # 32 per group: aligned
        nn.Conv2d(64, 48, 3, groups=4),       # 16 in / 12 out per group: out misaligned
        nn.Conv2d(48, 48, 3, groups=48),      # depthwise: not a GEMM, never reported
        nn.Conv2d(48, 8, 1),                  # aligned
    )
    assert summary(alignment_report(model, 8)) == [("2", "out_channels", 48, 64, False)]
    item = alignment_report(model, 8)[0]
    assert item.note == "4 groups of 12" and item.layer == "Conv2d"
    # Depthwise with an odd channel count is still skipped; only its neighbours' sizes show.
    odd = nn.Sequential(nn.Conv2d(8, 30, 1), nn.Conv2d(30, 30, 3, groups=30), nn.Conv2d(30, 8, 1))
    assert summary(alignment_report(odd, 8)) == [
        ("0", "out_channels", 30, 32, False),
        ("2", "in_channels", 30, 32, False),
    ]


def test_linear_in_and_out_features():
    model = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 64), nn.Linear(64, 10))
    assert summary(alignment_report(model, 32)) == [
        ("0", "out_features", 100, 104, False),
        ("2", "in_features", 100, 104, False),
        ("3", "out_features", 10, 16, True),
    ]
    first = alignment_report(nn.Sequential(nn.Linear(30, 64), nn.Linear(64, 8)), 8)[0]
    assert (first.what, first.fixed_by_data) == ("in_features", True)
    assert "30 input features" in first.note


def test_resnet_for_rgb_images_only_flags_rgb_and_classes():
    items = alignment_report(build_resnet(10, arch="resnet18", image_size=(32, 32)), 128)
    assert summary(items) == [("conv1", "in_channels", 3, 8, True), ("fc", "out_features", 10, 16, True)]


def test_lazy_layers_are_skipped_until_initialised():
    model = nn.Sequential(nn.LazyLinear(16), nn.Linear(16, 8))
    assert alignment_report(model, 8) == []


def test_format_report_lines():
    items = alignment_report(SmallCNN(10, 3, widths=(30, 64)), batch_size=50)
    lines = format_report(items)
    assert lines[0].startswith("per-device batch size 50 -> 56 (")
    assert lines[1] == "features.0.0 (Conv2d) out_channels 30 -> 32"
    assert lines[2] == "features.1.0 (Conv2d) in_channels 30 -> 32"
    assert lines[-2].startswith("features.0.0 (Conv2d) in_channels 3 -> 8 (set by the data: 3 input channels")
    assert lines[-1].startswith("head.3 (Linear) out_features 10 -> 16 (set by the data: 10 classes")

    short = format_report(items, limit=2)
    assert short == lines[:2] + [f"... and {len(items) - 2} more"]
    assert format_report([]) == []


def test_misalignment_is_frozen():
    item = Misalignment("batch", "batch_size", 50, 56, "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.value = 1  # type: ignore[misc]


def test_report_applies_only_on_cuda():
    assert report_applies("cuda") and report_applies("cuda:1")
    assert not any(report_applies(kind) for kind in ("cpu", "mps", "xla", "meta"))


def test_bad_arguments_are_programming_errors():
    with pytest.raises(ValueError):
        alignment_report(nn.Linear(8, 8), batch_size=0)
    with pytest.raises(ValueError):
        alignment_report(nn.Linear(8, 8), batch_size=8, multiple=0)
