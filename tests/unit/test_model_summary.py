"""The model summary printed as fit starts is Lightning's less its FLOP count (trainer/callbacks/model_summary.py),
and it follows Lightning's own switches: none with trainer.enable_model_summary=false or barebones, or
when a summary callback is given."""

import logging

from lightning.pytorch.callbacks import ModelSummary

from trainer.callbacks.model_summary import PlainModelSummary, RichModelSummaryWithoutFlops
from trainer.phases.build import _model_summary_wanted

DATA = [(" ", ["0", "1"]), ("Name", ["net", "loss"]), ("Type", ["SmallCNN", "MeanMetric"]), ("Params", ["288 K", "0"]),
        ("Mode", ["train", "train"]), ("FLOPs", ["0", "0"])]
TOTALS = dict(total_parameters=288_000, trainable_parameters=288_000, model_size=1.155,
              total_training_modes={"train": 49, "eval": 0}, total_flops=0)


def test_the_plain_summary_has_every_column_and_total_but_the_flops(caplog):
    with caplog.at_level(logging.INFO):
        PlainModelSummary.summarize(DATA, **TOTALS)
    text = caplog.text
    assert "SmallCNN" in text and "Total params" in text and "Modules in eval mode" in text
    assert "FLOP" not in text.upper()


def test_the_rich_summary_has_every_column_and_total_but_the_flops(capsys):
    RichModelSummaryWithoutFlops.summarize(DATA, **TOTALS)
    out = capsys.readouterr().out
    assert "SmallCNN" in out and "Total params" in out and "Mode" in out
    assert "FLOP" not in out.upper()


def test_the_summary_follows_lightnings_switches():
    assert _model_summary_wanted({}, [])
    assert not _model_summary_wanted({"enable_model_summary": False}, [])
    assert not _model_summary_wanted({"barebones": True}, [])
    assert not _model_summary_wanted({}, [ModelSummary(max_depth=2)])  # the person's own
