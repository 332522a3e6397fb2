"""The `data` group's room: data modules, decoding, loaders (docs/architecture.md places it)."""
