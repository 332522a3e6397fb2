"""The project's name on the package index and the installed versions of it and its libraries, read
from the packages' metadata (nothing is imported: `--version` answers without torch)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, packages_distributions, version

#: The distribution's name on the package index (pyproject.toml's [project] name).
DISTRIBUTION = "gpu-practice-trainer"


def installed_version(distribution: str) -> str:
    """The installed version of `distribution`, or "not installed"."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def project_version() -> str:
    return installed_version(DISTRIBUTION)


def import_name_clashes() -> list[str]:
    """Other installed distributions that also put files in the `trainer` import package (an
    unrelated `trainer` on the package index does): installed side by side, their files mix in one
    folder and either may break the other."""
    return sorted({d for d in packages_distributions().get("trainer", []) if d.lower().replace("_", "-") != DISTRIBUTION})
