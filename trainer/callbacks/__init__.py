"""Lightning callbacks of the framework (docs/architecture.md places them)."""
