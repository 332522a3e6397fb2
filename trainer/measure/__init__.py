"""Measurement and reports (docs/architecture.md places them)."""
