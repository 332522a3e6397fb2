"""What Hydra's sweepers need from the framework besides the run itself.

`PrepareStorage` (a Hydra callback, registered by the ``hparams_search`` configs) creates the
folder of a SQLite study storage before the sweeper opens it: SQLite creates the file but not its
folder, and a fresh checkout has no ``outputs/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from trainer.errors import UserError


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///relative`` or ``sqlite:////absolute`` URL; None for other storages."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url == prefix or ":memory:" in url:
        return None
    return Path(url[len(prefix):])


class PrepareStorage(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        storage = config.hydra.sweeper.get("storage")
        path = sqlite_path(str(storage)) if storage else None
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as ex:
            raise UserError("hydra.sweeper.storage", f"cannot create the folder of '{path}': {ex.strerror or ex}",
                            "a sqlite:///path/to/study.db in a writable folder") from None
