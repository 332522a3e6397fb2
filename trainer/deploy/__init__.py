"""The deployment layer: export, bench, serve and load (``python -m trainer.deploy --help``)."""

#: Dynamic batching's defaults, for ``serve`` and ``load`` alike.
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_BATCH_TIMEOUT_MS = 2.0
