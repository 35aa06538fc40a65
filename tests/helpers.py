"""Test helpers shared by the test files (fixtures live in conftest.py): data, processes, ports,
waits on real conditions, run files, file systems."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import time
from typing import Any, Callable

import numpy as np
import psutil
import pytest

from raytrain.report import read_metrics


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def metrics(run_dir) -> list[dict[str, Any]]:
    """The run's metrics.jsonl rows; [] before the first epoch."""
    return read_metrics(str(run_dir))


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               proc: subprocess.Popen | None = None, interval: float = 0.1) -> Any:
    """Poll ``condition`` until it is truthy (returned) or ``timeout`` s pass (an assertion
    naming ``what``); a ``proc`` that exits meanwhile fails at once with its output."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(interval)


def wait_for_epoch(run_dir, epoch: int, proc, timeout: float = 180) -> None:
    wait_until(lambda: any(r["epoch"] >= epoch for r in metrics(run_dir)), timeout,
               f"epoch {epoch} reported", proc)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until ``procs`` have exited (zombies count as gone); returns those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


@contextlib.contextmanager
def small_tmpfs(path, size: str, options: str = ""):
    """A real file system of ``size`` at ``path`` (needs root: this machine and CI have it)."""
    os.makedirs(path)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()[:120]}): a real full "
                    "disk needs mount permission (root)")
    try:
        yield path
    finally:  # lazily if a Ray process still holds a file open in it
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


@contextlib.contextmanager
def read_only_dir(path):
    """A directory nobody can write to, root included: a read-only tmpfs as root, else mode
    0500 (which root would ignore)."""
    if os.geteuid() == 0:
        with small_tmpfs(path, "1m", ",ro") as mounted:
            yield mounted
        return
    os.makedirs(path)
    os.chmod(path, 0o500)
    try:
        yield path
    finally:
        os.chmod(path, 0o700)
