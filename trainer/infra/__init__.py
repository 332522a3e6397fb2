"""What every module stands on (docs/architecture.md places it)."""
