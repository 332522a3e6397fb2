"""The package's structure, declared once: its layers (lowest first) and its config groups, each with
the module that owns it. docs/architecture.md shows both tables, written from here:

    python -m trainer.architecture           # check docs/architecture.md: exit 1 when out of date
    python -m trainer.architecture --write   # rewrite its tables

A module may import from its own folder and from the layers below it, never from a layer above or a
neighbour in its own; each folder sits just above the highest layer it imports from
(tests/unit/test_import_layers.py checks every import, that none goes round in a circle, and that no
folder is declared higher than its imports need).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from trainer.configuration import recipes
from trainer.configuration.reference import REPO, table, with_table
from trainer.configuration.spec import GROUPS
from trainer.groups import sweeps
from trainer.infra.schema import ConfigGroup
from trainer.measure import comparison

#: Each layer: the folders (or top-level modules) of `trainer/` it holds, and what lives there.
LAYERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("infra",), "what every module stands on: one-line errors, atomic and checkpoint files, the schema checker and "
                 "`_target_` building, signals, processes and devices, figures"),
    (("data", "models", "callbacks", "scaffold"), "the parts a run is made of: data modules, networks, Lightning "
                                                  "callbacks; and a team's starter folder, written from templates"),
    (("tasks",), "task definitions: what a batch is, the loss, the metrics, the unit a batch is counted in "
                 "(told what the data say)"),
    (("groups",), "one room per config group: its schema, its rules and its builder"),
    (("configuration",), "the whole config: every group validated into a frozen spec, Hydra's set-up, recipes, "
                         "key docs, --help"),
    (("measure", "deploy", "testing"), "what works from a validated config without a run: what measures "
                                       "(diagnosis, profile, memory plan, MFU, the sweep comparison), a trained "
                                       "run's export and serving, the public helpers for a team's tests"),
    (("task", "architecture", "generate"), "the LightningModule (loss, metrics, the optimizer and schedule from the "
                                           "plan); this declaration; text from a trained language model"),
    (("phases",), "the run's phases, each a function of one job, and the run record they pass on"),
    (("modes",), "the measurement modes entered instead of (or before) training"),
    (("run",), "the wiring: the one module that calls the phases in order"),
    (("cli",), "the command line: training, and the subcommands beside it (scaffold, deploy)"),
    (("__main__", "__init__"), "`python -m trainer`, and the package's public names (imported on first use, "
                               "from every layer)"),
)

#: Every config group of conf/ (and +recipe=): those a run's config holds, then Hydra's own.
ALL_GROUPS: tuple[ConfigGroup, ...] = (*GROUPS, sweeps.GROUP, comparison.GROUP, recipes.GROUP)

PAGE = REPO / "docs" / "architecture.md"


def layer_of(module: str) -> int:
    """The index in LAYERS of `module` (dotted, below `trainer`)."""
    top = module.split(".")[0]
    for index, (members, _) in enumerate(LAYERS):
        if top in members:
            return index
    raise KeyError(f"trainer.{module} is in no layer of trainer/architecture.py")


def layer_table() -> str:
    return table(["layer", "holds", "what lives there"], [
        (str(index), ", ".join(f"`{m}`" for m in members), what) for index, (members, what) in enumerate(LAYERS)])


def group_table() -> str:
    """Each group, its choices (the YAMLs of conf/GROUP/, recipes/ for +recipe=), the module that owns
    it and what a choice chooses."""
    rows = []
    for group in ALL_GROUPS:
        folder = recipes.RECIPES_DIR if group.name == recipes.RECIPE else recipes.CONF_DIR / group.name
        choices = ", ".join(f"`{path.stem}`" for path in sorted(folder.glob("*.yaml")))
        rows.append((f"`{group.name}`", choices, f"`{group.where}`", group.chooses))
    return table(["group", "choices", "owned by", "chooses"], rows)


def outdated(write: bool) -> bool:
    page = PAGE.read_text()
    wanted = with_table(with_table(page, "layers", layer_table()), "config groups", group_table())
    if wanted != page and write:
        PAGE.write_text(wanted)
    return wanted != page


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/architecture.md's tables")
    args = parser.parse_args(argv)
    if outdated(args.write) and not args.write:
        print(f"{PAGE.relative_to(REPO)}: its tables differ from trainer/architecture.py; "
              "python -m trainer.architecture --write rewrites them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
