"""Shared fixtures: one real local Ray cluster per test session (2 CPUs, like this machine)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import psutil
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


def write_tiny_cifar(root, n_per_batch: int = 20, n_test: int = 40, classes: int = 10,
                     seed: int = 0) -> str:
    """A tiny dataset in CIFAR-10's on-disk format (cifar-10-batches-py/ pickles).

    Images carry a learnable signal: the class sets the mean brightness of one channel.
    """
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)

    def batch(n: int) -> dict:
        labels = rng.integers(0, classes, n)
        images = rng.integers(0, 64, (n, 3, 32, 32)).astype(np.uint8)
        images[np.arange(n), labels % 3] += (labels * 19).astype(np.uint8)[:, None, None]
        return {"data": images.reshape(n, -1), "labels": labels.tolist(),
                "batch_label": "tiny"}

    for name in [f"data_batch_{i}" for i in range(1, 6)]:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch(n_per_batch), f)
    with open(os.path.join(folder, "test_batch"), "wb") as f:
        pickle.dump(batch(n_test), f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(classes)]}, f)
    return folder


def end_processes(procs: list[psutil.Process], grace_s: float = 10) -> None:
    """SIGTERM, wait ``grace_s``, then SIGKILL what is left (processes a test started)."""
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
