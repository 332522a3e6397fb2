"""The measurement modes, each entered from trainer/run.py by one call (docs/architecture.md lists them)."""
