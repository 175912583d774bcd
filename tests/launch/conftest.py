"""The launch tests' local Slurm cluster, started once for every test that asks for it."""

from __future__ import annotations

import pytest

from tests.launch.cluster import local_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
