"""The Trainer's checkpoint plugin: Lightning's reader and writer made atomic, weights-only and
prefix-free. Kept apart from the file work (trainer/infra/checkpoint_files.py) so that reading a
checkpoint or an export (`deploy serve`, `generate`) does not import Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from trainer.infra.atomic import replace_atomic
from trainer.infra.checkpoint_files import clean_state_dict, load_checkpoint
from trainer.infra.errors import UserError


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint reader and writer, made atomic, weights-only and prefix-free.
    Replaces `TorchCheckpointIO` deliberately (why: trainer/infra/checkpoint_files.py's docstring): every checkpoint the
    Trainer writes or reads, `last.ckpt`, the best ones and `ckpt_path=` loads, goes through here."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("SafeCheckpointIO takes no storage_options")
        if isinstance(checkpoint.get("state_dict"), Mapping):
            checkpoint = {**checkpoint, "state_dict": clean_state_dict(checkpoint["state_dict"])}
        replace_atomic(Path(path), lambda tmp: torch.save(checkpoint, tmp))

    def load_checkpoint(self, path: Any, map_location: Optional[Callable[..., Any]] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if weights_only is False:
            raise UserError(str(path), "asked to load with weights_only=False", "weights-only loading")
        return load_checkpoint(path, map_location if map_location is not None else "cpu")
