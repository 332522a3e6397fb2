"""The deployment layer: export, bench, serve, load and weights (``python -m trainer.deploy --help``)."""

#: Dynamic batching's defaults, for ``serve`` and ``load`` alike: no wait for more requests (on the
#: digits run a 2 ms wait halved a lone caller's QPS and bought nothing at 8 and 32; docs/deploy.md).
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_BATCH_TIMEOUT_MS = 0.0

#: ``serve``'s limits on one image: 10 MiB of JPEG or PNG, and 40 megapixels read from the header
#: before decoding (what cameras and phones write, while bounding one request's decode in the HTTP
#: process; docs/deploy.md says why 40 MP). Not derived from the model's input size.
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_PIXELS = 40_000_000

#: ``serve``'s limits on a text model's requests: a text's characters (checked before tokenizing; the
#: model reads at most its max_length tokens of it anyway), and the tokens one /generate may ask for.
DEFAULT_MAX_CHARS = 100_000
DEFAULT_MAX_NEW_TOKENS = 256
