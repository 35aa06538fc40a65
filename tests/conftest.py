"""Fixtures only (helpers: tests/helpers.py): one real local Ray cluster per test session (2 CPUs, like this machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto in server mode) on 127.0.0.1 for the session, and the
    standard environment every AWS client reads (endpoint, keys, region). Set before the Ray
    cluster starts, so its worker processes (Ray Data's read tasks) inherit it as every node
    of a real cluster has its credentials. Yields the endpoint URL."""
    import os

    from moto.server import ThreadedMotoServer

    from tests.helpers import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                       "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """A real local Ray cluster with 2 logical CPUs, shut down at the end of the session
    (started after the S3 environment is set: see ``s3_server``)."""
    import ray

    from raytrain.driver.cluster import train_env

    train_env()
    ctx = ray.init(address="local", num_cpus=2, logging_level="WARNING")
    yield ctx
    ray.shutdown()
