"""The `model` group's room: networks and their layers (docs/architecture.md places it)."""
