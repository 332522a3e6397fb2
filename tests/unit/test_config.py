"""`validate` on the composed config: the default config validates to the documented defaults;
each bad value (out of range, wrong type, unknown key, unknown Trainer argument, a key the
framework fills in, a missing or wrong `_target_`, a bad interpolation) is one line starting with
its full key; a team's model is checked against its own constructor signature."""

import pytest

from tests.helpers import compose
from trainer.configuration.spec import RunSpec, validate
from trainer.infra.errors import UserError


def test_default_config_validates_to_the_documented_defaults():
    spec = validate(compose())
    assert isinstance(spec, RunSpec)
    assert spec.data["_target_"] == "trainer.data.digits.DigitsDataModule"
    assert spec.data["batch_size"] == 64
    assert spec.optimizer.target == "torch.optim.AdamW" and spec.optimizer.arguments["betas"] == (0.9, 0.999)
    assert spec.scheduler.target == "trainer.groups.scheduler.warmup_cosine"
    assert spec.precision.name == "auto" and spec.compile.mode == "off"
    assert spec.checkpointing.enabled and spec.checkpointing.monitor == "val/loss"
    assert list(spec.loggers) == ["csv"]
    assert spec.trainer["max_epochs"] == 10


@pytest.mark.parametrize(
    "overrides, key, text",
    [
        (["optimizer.lr=0"], "optimizer.lr", "must be > 0"),
        (["optimizer=sgd", "optimizer.momentum=1.0"], "optimizer.momentum", "must be < 1"),
        (["optimizer=sgd", "optimizer.momentum=0"], "optimizer.nesterov", "needs momentum > 0"),
        (["optimizer.betas=[0.9,1.5]"], "optimizer.betas[1]", "must be < 1"),
        (["data.batch_size=0"], "data.batch_size", "must be >= 1"),
        (["data.batch_size=1.5"], "data.batch_size", "is not an integer"),
        (["+data.colour=red"], "data.colour", "unknown key"),
        (["model.widths=[32,0]"], "model.widths[1]", "must be >= 1"),
        (["+model.num_classes=3"], "model.num_classes", "filled in by the framework"),
        (["model=custom"], "model._target_", "missing mandatory value"),
        (["model=custom", "model._target_=collections.Nope"], "model._target_", "has no attribute 'Nope'"),
        (["data._target_=collections.OrderedDict"], "data._target_", "not a data module"),
        (["+trainer.precision=16"], "trainer.precision", "precision group"),
        (["+trainer.max_epoch=3"], "trainer.max_epoch", "unknown key for lightning.Trainer"),
        (["trainer.max_epochs=many"], "trainer.max_epochs", "is not an integer"),
        (["progress=loud"], "progress", "one of 'auto'"),
        (["+logger.csv.colour=1"], "logger.csv.colour", "unknown key"),
        (["+extra=1"], "extra", "unknown top-level key"),
        (["scheduler.warmup=-1"], "scheduler.warmup", "must be >= 0"),
        (["optimizer.lr=${nope}"], "optimizer.lr", "nope"),
    ],
)
def test_bad_values_name_their_key(overrides, key, text):
    with pytest.raises(UserError) as caught:
        validate(compose(overrides))
    line = caught.value.line()
    assert line.startswith(f"{key}: "), line
    assert text in line
    assert "\n" not in line


def test_a_team_model_is_checked_against_its_own_signature():
    spec = validate(compose(["model=custom", "model._target_=tests.helpers.TinyMLP", "+model.hidden=32"]))
    assert spec.model == {"_target_": "tests.helpers.TinyMLP", "hidden": 32}
    with pytest.raises(UserError, match=r"^model.depth: unknown key for tests.helpers.TinyMLP; allowed: hidden$"):
        validate(compose(["model=custom", "model._target_=tests.helpers.TinyMLP", "+model.depth=3"]))
