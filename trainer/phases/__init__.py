"""The run's phases and the record they pass on (docs/architecture.md describes them)."""
