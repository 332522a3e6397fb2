"""One room per config group (docs/architecture.md lists each group and the module that owns it)."""
