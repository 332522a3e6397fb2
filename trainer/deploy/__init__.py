"""The deployment layer: export, bench, serve and load (``python -m trainer.deploy --help``)."""

#: Dynamic batching's defaults, for ``serve`` and ``load`` alike. A batch is what queued while the
#: previous one ran, no wait for more by default: measured on the digits run (docs/deploy.md), a
#: 2 ms wait halved the QPS of a lone caller and bought nothing beyond the noise at 8 and 32.
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_BATCH_TIMEOUT_MS = 0.0
