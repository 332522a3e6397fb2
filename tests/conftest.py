import os

# Keep tests off any real experiment service and quiet about it.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
