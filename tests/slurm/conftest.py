"""The one-node SLURM the slurm-marked tests submit to: started once for the module that asks for
it (installing slurm-wlm first where it is missing and this is root), stopped by pid afterwards.
Where SLURM can be neither installed nor started, those tests are skipped with the reason."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import Cluster, Unavailable, start, stop


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    folder = tmp_path_factory.mktemp("slurm")
    try:
        cluster = start(folder)
    except Unavailable as ex:
        pytest.skip(f"no SLURM to test against: {ex}")
    try:
        yield cluster
    finally:
        stop(cluster)
