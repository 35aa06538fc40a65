"""Fixtures only (helpers: tests/helpers.py): one real local Ray cluster per test session (2 CPUs, like this machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster with 2 logical CPUs, shut down at the end of the session."""
    import ray

    from raytrain.driver.cluster import train_env

    train_env()
    ctx = ray.init(address="local", num_cpus=2, logging_level="WARNING")
    yield ctx
    ray.shutdown()
