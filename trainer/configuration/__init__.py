"""The configuration: each group's schema and `validate` (spec.py), the checking machinery
(schema.py), Hydra's set-up and one-line errors (hydra_setup.py), `--help` (help.py), which keys
two configs differ in (diff.py), building `_target_` objects with one-line errors
(instantiation.py) and team recipes (recipes.py)."""
