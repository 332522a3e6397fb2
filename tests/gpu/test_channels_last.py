"""channels_last on CUDA (precision.channels_last=auto): summary.json derives it true for a
convolutional model; during every training step the network's convolution weights are in NHWC
memory and the batch reaching the network is NHWC (not merely also NCHW-contiguous); the weights are
still NHWC after the run."""

from __future__ import annotations

import torch
from torch import nn

from tests.gpu.common import AUTO_RUN_STEPS, GPU

pytestmark = [*GPU]


def test_auto_derives_channels_last_for_a_convolutional_model(auto_run):
    derived = auto_run.summary["derived"]["precision.channels_last"]
    assert derived["value"] is True, derived
    assert derived["how"].startswith("auto -> true"), derived


def test_every_training_step_sees_nhwc_weights_and_an_nhwc_batch(auto_run):
    records = auto_run.net.records
    assert len(records) == AUTO_RUN_STEPS
    assert all(r.conv_weights_channels_last for r in records)
    assert all(r.input_channels_last and not r.input_nchw_contiguous for r in records)


def test_the_weights_stay_nhwc_after_training(auto_run):
    convs = [m for m in auto_run.net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 2
    for conv in convs:
        # Lightning moves the module back to the CPU at the end; .cpu() keeps the strides.
        assert conv.weight.is_contiguous(memory_format=torch.channels_last), conv
        assert not conv.weight.is_contiguous(), conv
