"""The `data` group: a choice names a data module of this framework (`_target_`, checked against its
constructor), and `build_data` makes it for a run."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from hydra.utils import instantiate

from trainer.data.base import DataInfo, DataModule
from trainer.infra.errors import UserError
from trainer.infra.extras import require
from trainer.infra.instantiation import construct
from trainer.infra.schema import ConfigGroup, check_target, locate_target


def validate(values: dict[str, Any]) -> dict[str, Any]:
    if str(values.get("_target_", "")) == "trainer.data.shards.ShardsDataModule":
        require("shards", "data=shards")  # LitData and boto3
    data = check_target("data", values)
    data_cls = locate_target("data", data["_target_"])
    if not (inspect.isclass(data_cls) and issubclass(data_cls, DataModule)):
        raise UserError("data._target_", f"'{data['_target_']}' is not a data module of this framework",
                        "a subclass of trainer.data.base.DataModule")
    if "batch_size" not in data:
        raise UserError("data.batch_size", "missing", "a positive integer (per-device batch size)")
    return data


def build_data(cfg: dict[str, Any], run_dir: Path, seed: int) -> tuple[DataModule, DataInfo]:
    """The data module, told the run's folder and seed, and what it found in its source."""
    datamodule = construct("data", lambda: instantiate(cfg, _convert_="all"))
    datamodule.attach_run(run_dir, seed)
    info = datamodule.inspect()
    train_size = info.sizes.get("train", 0)
    if train_size < datamodule.batch_size:
        raise UserError("data.batch_size", f"{datamodule.batch_size} is larger than the training split "
                        f"({train_size} samples); the last partial batch is dropped, so no step would run",
                        f"at most {train_size}")
    return datamodule, info


GROUP = ConfigGroup("data", __name__, "the data set and its loader (one module per choice in trainer/data/)",
                    validate, target=True)
