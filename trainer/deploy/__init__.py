"""The deployment layer: export, bench, serve, load and weights (``python -m trainer.deploy --help``)."""

#: Dynamic batching's defaults, for ``serve`` and ``load`` alike. A batch is what queued while the
#: previous one ran, no wait for more by default: measured on the digits run (docs/deploy.md), a
#: 2 ms wait halved the QPS of a lone caller and bought nothing beyond the noise at 8 and 32.
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_BATCH_TIMEOUT_MS = 0.0

#: ``serve``'s limits on one image. The body: 10 MiB of JPEG or PNG (base64 in JSON or a data URL may
#: take a third more). The pixels, read from the header before decoding: 40 megapixels covers what
#: cameras and phones write by default (12 to 24 MP, most cameras up to 40) while bounding what one
#: request costs the HTTP process, which decodes every image: 120 MB of RGB, and 1.3 s to decode and
#: resize a 40 MP PNG on the 2-core test machine (a 12000 x 12000 PNG of 140 KB takes 3.4 s to decode).
#: Not derived from the model's input size: clients send photos whatever the network's input, and
#: every image is resized down to it anyway.
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_PIXELS = 40_000_000
