"""The random number generators' states travel with every checkpoint.

Lightning's checkpoint holds no RNG states, so a resumed run's dropout and on-device augmentation
would draw different numbers. This callback saves the python, numpy, torch CPU and CUDA states (as
tensors and plain containers, for weights-only loading) and puts them back at ``on_train_start``,
not when the checkpoint is read: the sanity-check validation runs in between, and nothing of it
must count. (The loaders draw from generators of their own.)"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback


def capture() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((int(python["version"]), tuple(int(v) for v in python["state"].tolist()), python["gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state({"bit_generator": numpy_state["bit_generator"],
                         "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": int(numpy_state["pos"])},
                         "has_gauss": int(numpy_state["has_gauss"]), "gauss": float(numpy_state["gauss"])})
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # another number of GPUs: each device takes the state of its own index where there is one
            for index, device_state in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(device_state, index)


class RNGState(Callback):
    def __init__(self) -> None:
        self._to_restore: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return capture()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._to_restore is not None:
            restore(self._to_restore)
            self._to_restore = None
