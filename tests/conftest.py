"""Fixtures only (helpers: tests/helpers.py): one real local Ray cluster per test session (2 CPUs,
like this machine); under `-n 2` (pytest-xdist, README) one per pytest process."""

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
    from raytrain import ray_compat
    from raytrain.driver.cluster import train_env

    train_env()
    # log_to_driver=False, as the CLI's own driver without --verbose: a process of an earlier
    # test (a TrainController logging "[State Transition] ... -> FINISHED." at INFO) must not
    # print into a later test's captured output (seen once in CI, in test_cli's one-line check).
    ctx = ray_compat.init_local(num_cpus=2, logging_level="WARNING", log_to_driver=False)
    # init_local leaves the driver $RAY_ADDRESS (its own processes already have it): the tests'
    # child processes (`python -m raytrain.fit` without --address) must start a cluster of
    # their own, as from a user's shell, not join this one.
    import os

    os.environ.pop("RAY_ADDRESS", None)
    yield ctx
    ray_compat.shutdown()
    _end_stragglers(ctx.address_info["session_dir"])


def _end_stragglers(session_dir: str, grace_s: float = 20) -> None:
    """Processes of the session's cluster still alive ``grace_s`` after ray.shutdown() (seen
    once in CI: a streamed run's TrainController, its raylet gone, alive 25 min later) are
    killed, and named: .ci/run's check that Ray left nothing behind then sees what is real."""
    import os
    import time

    import psutil

    def mine() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:  # not this process: the driver keeps its own log there open
                if proc.pid != os.getpid() and any(f.path.startswith(session_dir)
                                                   for f in proc.open_files()):
                    found.append(proc)
            except (psutil.Error, OSError):
                pass
        return found

    deadline = time.monotonic() + grace_s
    while (left := mine()) and time.monotonic() < deadline:
        time.sleep(1)
    for proc in left:
        try:
            print(f"conftest: ending {proc.pid} {proc.name()}, alive after ray.shutdown()")
            proc.kill()
        except psutil.Error:
            pass


_HELD: list[bool] = []  # the session cluster's CPUs stayed held once: no more waiting


@pytest.fixture(autouse=True)
def cluster_idle_before(request):
    """A test on the session's cluster starts when the cluster's 2 CPUs are free again: Ray
    frees an ended run's (or Tune trial's) placement group asynchronously, and a run that
    starts before would wait Ray Train's 60 s for its workers and fail. Names what still
    holds CPUs after 90 s."""
    if "ray_cluster" in request.fixturenames:
        import time

        import ray

        request.getfixturevalue("ray_cluster")  # started first

        started = time.monotonic()
        deadline = time.monotonic() + (0 if _HELD else 60)
        while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
            if time.monotonic() > deadline:  # once held for good, later tests fail at once
                from ray.util import placement_group_table

                _HELD.append(True)
                held = {k: v for k, v in placement_group_table().items()
                        if v.get("state") != "REMOVED"}
                pytest.fail(f"the session cluster's CPUs are still held: {held}")
            time.sleep(0.1)
        if (waited := time.monotonic() - started) >= 0.1:
            _WAITED[request.node.nodeid] = waited
    yield


# Test files, heaviest first: CPU-seconds of each file alone as one process (2 cores,
# 2026-12-07; the suite 2369 CPU-s in 27:48). Under `-n 2 --dist loadfile` a process takes the
# next file when its own is nearly done, so the suite ends on short files and both processes end
# together; xdist's own order (most tests first) left the heavy few-test files (node loss: 4
# tests, 267 CPU-s; S3; monitoring) for the end, one process on them alone. A file not listed
# (unknown cost) goes first.
BY_COST = ("test_own_data.py", "test_node_loss.py", "test_fault_tolerance.py",
           "test_robustness.py", "test_tune.py", "test_s3.py", "test_flags.py",
           "test_predict.py", "test_benchmarks.py", "test_mlflow.py", "test_train.py",
           "test_cluster.py", "test_startup.py", "test_monitoring.py", "test_streaming.py",
           "test_cli.py", "test_seed_recipes.py", "test_examples.py", "test_recipe.py",
           "test_docs.py", "test_architecture.py", "test_data.py", "test_onprem.py")


FULL_DISK = 0.90  # Ray's own limit (RAY_local_fs_capacity_threshold) is 0.95


def pytest_configure(config):
    """xdist schedules files in collection order (``pytest_collection_modifyitems``), not
    reordered by how many tests each has. A disk too full for Ray to spill on ends the run
    here, in one line, not as two streaming tests' OutOfDiskError half an hour in."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    import os
    import shutil
    import tempfile

    where = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    disk = shutil.disk_usage(where)
    if (disk.total - disk.free) / disk.total > FULL_DISK:
        pytest.exit(f"the disk holding {where} (Ray's temp dir) is over {FULL_DISK:.0%} full "
                    f"({disk.free / 2**30:.1f} GiB free): Ray refuses to spill objects at 95% "
                    "and the streaming tests would fail; free some space first", returncode=3)


def pytest_collection_modifyitems(items):
    """Files in ``BY_COST`` order, each file's tests in their own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(BY_COST)}
    items.sort(key=lambda item: rank.get(item.path.name, -1))


_WAITED: dict[str, float] = {}  # test -> seconds it waited for the session cluster's CPUs


def pytest_terminal_summary(terminalreporter):
    """How long tests waited for CPUs an earlier test's run still held (the suite's time)."""
    if _WAITED:
        worst = sorted(_WAITED.items(), key=lambda kv: -kv[1])[:5]
        terminalreporter.write_line(
            f"waited for the session cluster's CPUs: {sum(_WAITED.values()):.1f}s in "
            f"{len(_WAITED)} tests; most: " + ", ".join(f"{k} {v:.1f}s" for k, v in worst))
