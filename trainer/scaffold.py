"""``python -m trainer scaffold DIR [--package NAME]``: a starter team folder.

Two examples side by side: a classification recipe on a shipped one with the team's own network and
data module, and a regression task of the team's own (a `TaskDefinition`, scikit-learn's diabetes
table, an MLP) with a test that trains it and beats predicting the mean. The folder is a repository:
a pyproject.toml on the framework's minor series, a .gitignore for the runs, and tests that use only
`trainer.testing`. docs/install.md ("A team's own folder") says how it is used, docs/tasks.md how a
task is written."""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Optional

from trainer.infra.command import invoked_as, subcommand
from trainer.infra.errors import UserError, one_line_on_user_error
from trainer.infra.versions import DISTRIBUTION, project_version

#: The folder's files, in the order they are written and listed, each a template in
#: trainer/scaffold_templates/ under the path of the file it becomes, with PACKAGE for the team's
#: package. Where the real name would make a tool take the template for this project's own file, the
#: name is changed: `.txt` added to Python modules (ruff, mypy, pytest, the layer test) and
#: pyproject.toml, and .gitignore without its dot (git would obey it). A template holding any of
#: `{package}`, `{requirement}`, ... is filled in with `str.format`; one without is written as it is.
TEMPLATES = (
    "README.md", "pyproject.toml.txt", "gitignore.txt",
    "recipes/PACKAGE_digits.yaml", "conf/model/PACKAGE_net.yaml", "conf/data/PACKAGE_digits.yaml",
    "PACKAGE/__init__.py.txt", "PACKAGE/models.py.txt", "PACKAGE/data.py.txt", "tests/test_recipes.py.txt",
    "recipes/diabetes_regression.yaml", "conf/task/regression.yaml", "conf/data/diabetes.yaml",
    "conf/model/mlp.yaml", "PACKAGE/tasks.py.txt", "PACKAGE/tabular.py.txt", "tests/test_regression.py.txt",
)


def template_text(template: str) -> str:
    """A template as the package ships it (an installed wheel too)."""
    return resources.files("trainer").joinpath("scaffold_templates", template).read_text(encoding="utf-8")


def written_name(template: str, package: str) -> str:
    """The path, inside the team folder, of the file `template` becomes."""
    name = template.removesuffix(".txt").replace("PACKAGE", package)
    return "." + name if name == "gitignore" else name


def framework_requirement(version: str) -> str:
    """The framework as a dependency: the minor series of `version` for 0.x (``>=0.1,<0.2``: a 0.x
    minor may change what a team's folder relies on), its major series from 1.0 (``>=1.2,<2``); the
    bare name when the version is not known (a checkout that is not installed)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        return DISTRIBUTION
    major, minor = int(match.group(1)), int(match.group(2))
    upper = f"0.{minor + 1}" if major == 0 else str(major + 1)
    return f"{DISTRIBUTION}>={major}.{minor},<{upper}"


def scaffold(folder: Path, package: Optional[str] = None) -> list[Path]:
    """Write the starter team folder into `folder` (new or empty); the files written."""
    package = package or re.sub(r"\W+", "_", folder.resolve().name).strip("_").lower() or "team"
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", package):
        raise UserError("--package", f"'{package}' is not a Python package name", "lowercase letters, digits, _")
    if folder.exists() and any(folder.iterdir()):
        raise UserError(str(folder), "is not empty; scaffold writes a new team folder",
                        "a new or empty folder")
    requirement = framework_requirement(project_version())
    values = {"package": package, "requirement": requirement, "framework": DISTRIBUTION,
              "specifier": requirement[len(DISTRIBUTION):], "version": project_version(),
              "distribution": re.sub(r"[^a-z0-9]+", "-", folder.resolve().name.lower()).strip("-") or package}
    written = []
    for template in TEMPLATES:
        text = template_text(template)
        path = folder / written_name(template, package)
        path.parent.mkdir(parents=True, exist_ok=True)
        formatted = any("{" + key + "}" in text for key in values)
        path.write_text(text.format(**values) if formatted else text)
        written.append(path)
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog=subcommand("scaffold"), description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the team folder to write (new or empty)")
    parser.add_argument("--package", help="the team's Python package (default: the folder's name)")
    args = parser.parse_args(argv)
    with one_line_on_user_error():
        written = scaffold(args.folder, args.package)
    for path in written:
        print(path)
    recipe = next(path.stem for path in written if path.parent.name == "recipes")
    print(f"then: cd {args.folder} && pip install -e '.[test]' && {invoked_as()} +recipe={recipe}", file=sys.stderr)
