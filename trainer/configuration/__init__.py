"""The whole config: validation, Hydra's set-up, recipes, key docs (docs/architecture.md places it)."""
