"""The deployment layer: ``python -m trainer.deploy export RUN_DIR|CKPT`` (see `trainer.deploy.export`)."""
