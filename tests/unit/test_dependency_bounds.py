"""pyproject.toml's lower bounds admit no release that lacks what the code and the configs use: a
bound lowered below a row of `NEEDS` fails here, and so does a row whose feature is gone (the row
can go with it)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


class Need(NamedTuple):
    distribution: str
    minimum: str
    #: Where the feature is used, and a string there that shows it.
    path: str
    uses: str
    why: str


NEEDS = [
    Need("hydra-optuna-sweeper", "1.3.0", "conf/hparams_search/digits_optuna.yaml", "max_failure_rate:",
         "1.2.0's OptunaSweeperConf has no max_failure_rate: composing the study config fails (hydra#2215, #2313)"),
    Need("litserve", "0.2.19", "trainer/deploy/serve.py", "def get_batch_requests(",
         "the batch collection and the request handler that serve.py replaces were read in 0.2.19's source"),
    Need("hydra-core", "1.3.0", "trainer/cli.py", 'version_base="1.3"', "version_base 1.3 is known from hydra-core 1.3"),
]

#: Releases that must never be admitted whatever the bounds.
NEVER = {"lightning": ["2.6.2", "2.6.3"]}  # compromised releases


def dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *(line for extra in project["optional-dependencies"].values() for line in extra)]
    requirements = [Requirement(line) for line in lines if not line.startswith(project["name"] + "[")]
    return {r.name.lower(): r for r in requirements}


def lower_bound(requirement: Requirement) -> Version | None:
    """The least version the requirement admits, as far as its specifiers bound it from below
    (``>1.2`` counts as 1.2: anything it admits is above that)."""
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", ">", "==", "~=", "===")]
    return max(bounds, default=None)


@pytest.mark.parametrize("need", NEEDS, ids=lambda n: n.distribution)
def test_the_lower_bound_admits_no_release_without_what_is_used(need):
    requirement = dependencies().get(need.distribution)
    assert requirement is not None, f"{need.distribution} is used ({need.path}) but not a dependency"
    bound = lower_bound(requirement)
    assert bound is not None and bound >= Version(need.minimum), (
        f"pyproject.toml admits {requirement}, but {need.path} needs >= {need.minimum}: {need.why}")


@pytest.mark.parametrize("need", NEEDS, ids=lambda n: n.distribution)
def test_each_row_names_a_feature_still_in_use(need):
    assert need.uses in (REPO / need.path).read_text(), f"{need.path} no longer uses {need.uses!r}: drop the row"


@pytest.mark.parametrize("distribution", sorted(NEVER))
def test_known_bad_releases_are_excluded(distribution):
    requirement = dependencies()[distribution]
    admitted = [v for v in NEVER[distribution] if requirement.specifier.contains(v, prereleases=True)]
    assert not admitted, f"pyproject.toml's {requirement} admits {admitted}"


def test_the_lower_bound_check_itself_catches_a_lowered_bound():
    assert lower_bound(Requirement("hydra-optuna-sweeper>=1.2,<1.4")) == Version("1.2")
    assert lower_bound(Requirement("torchmetrics<2")) is None
    assert lower_bound(Requirement("x>=1.0,>=1.6.2")) == Version("1.6.2")
