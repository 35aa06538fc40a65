"""Robustness on a real cluster: resources it cannot get, NaN losses, Ctrl-C, bad addresses,
a storage file system that fills up (a real tmpfs), an elastic run waiting for a node."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import torch
import yaml

from raytrain import fit, report
from raytrain.driver import preflight
from raytrain.driver.run import latest_checkpoint_epoch
from tests.helpers import (AWS, ONPREM, LocalCluster, free_port, metrics, small_tmpfs,
                           wait_for_epoch, wait_gone, wait_until)


def test_oversized_worker_count_fails_fast_with_the_resource_message(ray_cluster, tmp_path,
                                                                      capsys):
    start = time.monotonic()
    rc = fit.main(["--num-workers", "8", "--dataset", "digits", "--storage-path",
                   str(tmp_path), "--name", "big"])
    assert rc == 2 and time.monotonic() - start < 30
    err = capsys.readouterr().err.strip()
    assert "--num-workers 8 needs 8 x (1 CPU)" in err and "the cluster has 2 CPUs" in err
    assert not (tmp_path / "big").exists()


def test_use_gpu_without_gpus_fails_fast(ray_cluster, tmp_path, capsys):
    rc = fit.main(["--num-workers", "1", "--use-gpu", "--dataset", "digits",
                   "--storage-path", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "1 GPU" in err and "0 GPUs" in err and "drop --use-gpu" in err


def test_workers_whose_cpus_other_jobs_hold_wait_then_stop_in_one_line(ray_cluster, tmp_path,
                                                                      capfd):
    """The session cluster's 2 CPUs held by another job (a real placement group): the run fits
    the cluster's totals, so it starts, says it waits --wait-timeout, then stops in one line
    (Ray Train alone: 4 x 60 s of worker-group start timeouts, then its own error)."""
    import ray
    from ray.util import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready(), timeout=30)
    try:
        start = time.monotonic()
        rc = fit.main(["--num-workers", "1", "--dataset", "digits", "--epochs", "1",
                       "--wait-timeout", "4", "--storage-path", str(tmp_path), "--name", "held"])
        took = time.monotonic() - start
    finally:
        remove_placement_group(pg)
    out, err = capfd.readouterr()
    assert rc == 1 and took < 60, (took, err)
    assert "other jobs hold the cluster's resources" in out, out
    errors = [line for line in err.splitlines() if line.startswith("raytrain: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "raytrain: error: --wait-timeout 4s: no room for 1 worker(s) free on the cluster "
        "(other jobs hold the rest)"), err
    assert not metrics(tmp_path / "held")
    wait_until(lambda: ray.available_resources().get("CPU") == 2, 15, "the CPUs all free")
    time.sleep(3)  # nothing of the run starts late and holds one
    assert ray.available_resources().get("CPU") == 2


def test_nan_loss_stops_the_run_naming_epoch_and_step(ray_cluster, tmp_path, capsys):
    rc = fit.main(["--num-workers", "2", "--dataset", "digits", "--lr", "1e8", "--epochs",
                   "3", "--storage-path", str(tmp_path), "--name", "nan"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "loss became NaN/inf at epoch 1, step" in err and "--nan-policy skip" in err
    assert [r["epoch"] for r in metrics(tmp_path / "nan")] == [1]  # stopped, not retried
    assert not list((tmp_path / "nan").glob("checkpoint_*"))  # no diverged checkpoint


def test_nan_policy_skip_keeps_weights_finite(ray_cluster, tmp_path):
    rc = fit.main(["--num-workers", "2", "--dataset", "digits", "--lr", "1e8", "--epochs",
                   "1", "--nan-policy", "skip", "--storage-path", str(tmp_path), "--name", "s"])
    assert rc == 0
    state = torch.load(tmp_path / "s" / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values())


def test_unreachable_address_fails_within_30s():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raytrain.fit", "--address",
                           "127.0.0.1:9", "--dataset", "digits"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 30
    assert proc.stderr.strip().startswith("raytrain: error: --address 127.0.0.1:9")
    assert "Traceback" not in proc.stderr


def test_a_stale_ray_address_file_does_not_delay_the_end_of_a_run(tmp_path):
    """Ray's address file naming a dead cluster (what a killed `ray start --head` leaves) made
    runs end ~40 s after their last epoch: Ray Train's state actor, reconciling every 30 s,
    asked the State API, which followed the file to the dead GCS while holding the lock the
    controller's last update waits for (issue #27). Here the file is in a private Ray temp dir
    ($RAY_TMPDIR: the machine's /tmp/ray is never touched) and the actor reconciles every 1 s,
    so every run of this length meets it: without the fix this run ended 40+ s late."""
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live here
    try:
        os.makedirs(os.path.join(ray_tmp, "ray"))
        stale = os.path.join(ray_tmp, "ray", "ray_current_cluster")
        with open(stale, "w") as f:
            f.write(f"127.0.0.1:{free_port()}")  # nothing listens there
        env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp,
               "RAY_TRAIN_STATE_ACTOR_RECONCILIATION_INTERVAL_S": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "raytrain.fit", "--num-workers", "1",
                                 "--dataset", "digits", "--epochs", "6", "--storage-path",
                                 str(tmp_path), "--name", "stale"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        out, _ = proc.communicate(timeout=240)
        _ended_with_its_last_epoch(proc.returncode, out, tmp_path / "stale")
        with open(stale) as f:  # Ray's file, as it was
            assert f.read().startswith("127.0.0.1:")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_stale_address_file_does_not_delay_a_run_on_a_running_cluster(tmp_path):
    """The same on a cluster started with `ray start --head` (--address): its processes read
    the address file of their temp dir, which here names a dead cluster after the head has
    started (a later `ray start` killed on the machine). The state actor raytrain makes there
    is given the cluster's address (ray_compat.start_train_state_actor)."""
    cluster = LocalCluster()
    try:  # its processes' default temp dir is the head's --temp-dir: the file they read
        cluster.env["RAY_TMPDIR"] = str(cluster.base)
        cluster.start_head()
        stale = cluster.base / "ray" / "ray_current_cluster"
        assert stale.read_text().strip().endswith(f":{cluster.port}")  # `ray start` wrote it
        stale.write_text(f"127.0.0.1:{free_port()}")  # nothing listens there
        env = {**cluster.client_env, "RAY_TRAIN_STATE_ACTOR_RECONCILIATION_INTERVAL_S": "1"}
        proc = subprocess.run([sys.executable, "-m", "raytrain.fit", "--address",
                               cluster.address, "--num-workers", "1", "--dataset", "digits",
                               "--epochs", "6", "--storage-path", str(tmp_path), "--name",
                               "stale"], capture_output=True, text=True, env=env, timeout=240)
        _ended_with_its_last_epoch(proc.returncode, proc.stdout + proc.stderr,
                                   tmp_path / "stale")
    finally:
        cluster.stop()


def _ended_with_its_last_epoch(returncode: int, out: str, run_dir) -> None:
    """A 6-epoch run that just ended did so within 10 s of writing its last epoch."""
    ended = time.time()
    assert returncode == 0, out
    assert [r["epoch"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    last_epoch = os.path.getmtime(run_dir / "metrics.jsonl")
    assert ended - last_epoch < 10, f"ended {ended - last_epoch:.1f} s after its last epoch"


def test_ctrl_c_stops_workers_and_leaves_no_ray_processes(tmp_path):
    """The driver starts its own local cluster; SIGINT must take all of it down."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "raytrain.fit", "--num-workers", "1",
                             "--dataset", "synthetic", "--synthetic-size", "3200",
                             "--epochs", "50", "--storage-path", str(tmp_path),
                             "--name", "int"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    metrics = tmp_path / "int" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    ray_procs = psutil.Process(proc.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in ray_procs)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, out
    assert "interrupted after epoch" in out
    kept = [d for d in os.listdir(tmp_path / "int") if d.startswith("checkpoint_epoch_")]
    assert 1 <= len(kept) <= 2, kept  # --keep-checkpoints' default, none Ray does not know
    alive = wait_gone(ray_procs, timeout=3)
    assert not alive, [p.cmdline()[:2] for p in alive]


# ---------------------------------------------------------------------------- a full disk


def fill(path, leave: int) -> None:
    """Take all free space on ``path``'s file system but ``leave`` bytes."""
    st = os.statvfs(path)
    with open(os.path.join(path, "filler"), "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - leave))


def test_metrics_files_survive_a_full_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        rows = [{"epoch": e, **{k: 0.5 for k in report.METRICS[1:]}} for e in (1, 2)]
        for row in rows:
            report.record_epoch(str(disk), row)
        report.append_event(str(disk), {"event": "log", "text": "before"})
        before = {n: (disk / n).read_bytes() for n in ("metrics.jsonl", "metrics.csv",
                                                       "events.jsonl")}
        fill(disk, leave=0)
        with pytest.raises(OSError):
            report.record_epoch(str(disk), {**rows[1], "epoch": 3, "note": "x" * 8000})
        with pytest.raises(OSError):
            report.append_event(str(disk), {"event": "log", "text": "y" * 8000})
        assert {n: (disk / n).read_bytes() for n in before} == before  # unchanged, no junk
        assert sorted(os.listdir(disk)) == sorted([*before, "filler"])
        assert [r["epoch"] for r in report.read_metrics(str(disk))] == [1, 2]


def test_latest_checkpoint_ignores_a_checkpoint_without_a_complete_state_file(tmp_path):
    for epoch in (1, 2, 3, 4):
        (tmp_path / f"checkpoint_epoch_{epoch:04d}").mkdir()
    torch.save({"w": torch.zeros(1000)}, tmp_path / "checkpoint_epoch_0001" / "state.pt")
    whole = (tmp_path / "checkpoint_epoch_0001" / "state.pt").read_bytes()
    (tmp_path / "checkpoint_epoch_0002" / "state.pt").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "checkpoint_epoch_0004" / "state.pt").write_bytes(whole)
    # Ray Train's record of the checkpoints it registered (4 is not: rank 0 wrote it, then
    # Ctrl-C came before report() registered it)
    names = [{"checkpoint_dir_name": f"checkpoint_epoch_{e:04d}"} for e in (1, 2, 3)]
    (tmp_path / "checkpoint_manager_snapshot.json").write_text(json.dumps(
        {"checkpoint_results": names, "latest_checkpoint_result": names[-1]}))
    assert latest_checkpoint_epoch(str(tmp_path)) == 1  # 2: cut short, 3: empty, 4: not Ray's


# digits epochs of ~1 s here: time to fill the disk between one epoch's files and the next's.
# LeNet: its ~0.5 MB checkpoints fit the 6 MB tmpfs (the seed's Net's are ~17 MB).
FULL_DISK_RUN = ["--num-workers", "2", "--dataset", "digits", "--batch-size", "32",
                 "--model", "lenet",
                 "--checkpoint-every", "2", "--name", "full"]


def _fit_on(disk, address: str, *args: str) -> tuple[list[str], subprocess.Popen]:
    cmd = [sys.executable, "-m", "raytrain.fit", "--address", address, *FULL_DISK_RUN,
           "--storage-path", str(disk), *args]
    # Its own process group: _fails_on_full_disk can end the driver and anything it started.
    return cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)


def _fails_on_full_disk(proc, disk, what: str) -> None:
    """``proc`` ends with exit 1 and exactly one line on stderr: ``what`` failed on the full
    ``disk``, the epoch 2 checkpoint is intact, how to go on; no traceback."""
    try:
        out, err = proc.communicate(timeout=120)
    finally:  # a hung driver (communicate timed out) must not outlive the test
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, out + err
    assert err == (f"raytrain: error: {what}: [Errno 28] No space left on device "
                   f"(--storage-path {disk}); the epoch 2 checkpoint is intact; free space "
                   "and rerun the same command to resume\n")
    assert "Traceback" not in out


def test_full_disk_on_checkpoint_save_stops_the_run_and_keeps_what_was_saved(
        ray_cluster, tmp_path):
    with small_tmpfs(tmp_path / "disk", "6m") as disk:
        run_dir = disk / "full"
        cmd, proc = _fit_on(disk, ray_cluster.address_info["gcs_address"], "--epochs", "6")
        wait_for_epoch(run_dir, 2, proc)  # its row is written once its checkpoint is whole
        state = run_dir / "checkpoint_epoch_0002" / "state.pt"
        saved = state.read_bytes()
        fill(disk, leave=128 * 1024)  # room for metrics lines, not for a checkpoint
        assert len(saved) > 3 * 128 * 1024
        _fails_on_full_disk(proc, disk, "checkpoint save failed at epoch 4")
        assert state.read_bytes() == saved
        assert torch.load(state, weights_only=True)["epoch"] == 2
        assert not (run_dir / "checkpoint_epoch_0004").exists()  # no partial checkpoint
        assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
        rows = _rows(run_dir)
        assert [r["epoch"] for r in rows] == [1, 2, 3, 4] and "error" in rows[-1]
        assert latest_checkpoint_epoch(str(run_dir)) == 2

        os.remove(disk / "filler")
        rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert "resuming run full from its epoch 2 checkpoint (4 epochs to go)" in rerun.stdout
        assert re.findall(r"^epoch +(\d)/6", rerun.stdout, re.M) == ["3", "4", "5", "6"]
        rows = _rows(run_dir)
        assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5, 6]
        assert not any("error" in r for r in rows)
        assert torch.load(run_dir / "checkpoint_epoch_0006" / "state.pt",
                          weights_only=True)["epoch"] == 6


def test_full_disk_on_metrics_write_stops_the_run_and_keeps_what_was_saved(
        ray_cluster, tmp_path):
    with small_tmpfs(tmp_path / "disk", "6m") as disk:
        run_dir = disk / "full"
        _, proc = _fit_on(disk, ray_cluster.address_info["gcs_address"], "--epochs", "4")
        wait_for_epoch(run_dir, 2, proc)
        before = (run_dir / "metrics.jsonl").read_bytes()
        fill(disk, leave=0)  # epoch 3 saves no checkpoint: its metrics are the next write
        _fails_on_full_disk(proc, disk, "writing the run files failed")
        assert (run_dir / "metrics.jsonl").read_bytes() == before
        assert [r["epoch"] for r in _rows(run_dir)] == [1, 2]
        assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
        assert latest_checkpoint_epoch(str(run_dir)) == 2


def _rows(run_dir) -> list[dict]:
    try:
        return report.read_metrics(str(run_dir))
    except ValueError:  # never expected: metrics.jsonl is replaced whole
        raise AssertionError(f"{run_dir}/metrics.jsonl does not parse") from None


# ---------------------------------------------------------------------------- elastic wait


@pytest.fixture(scope="module")
def one_cpu_head():
    """A cluster of its own: a 1-CPU head (token auth, like cluster.yaml); nodes join later."""
    cluster = LocalCluster()
    try:
        cluster.start_head()
        yield cluster
    finally:
        cluster.stop()


def _start_fit(cluster: LocalCluster, *args: str, home=None) -> tuple[subprocess.Popen, list]:
    """raytrain.fit against ``cluster``, and its output lines as (time, line), as they come.
    ``home``: its $HOME (the token comes from RAY_AUTH_TOKEN_PATH, not from ~/.ray)."""
    proc = subprocess.Popen([sys.executable, "-m", "raytrain.fit", "--address", cluster.address,
                             "--dataset", "digits", "--storage-path", str(cluster.base / "runs"),
                             *args], env=cluster.client_env | ({"HOME": str(home)} if home
                                                               else {}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    proc.reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), line.rstrip("\n")) for line in proc.stdout), daemon=True)
    proc.reader.start()
    return proc, lines


def _seen(lines: list, text: str) -> float | None:
    return next((t for t, line in list(lines) if text in line), None)


def test_elastic_run_fails_after_wait_timeout_when_min_workers_never_fit(one_cpu_head):
    proc, lines = _start_fit(one_cpu_head, "--num-workers", "2:3", "--wait-timeout", "4",
                             "--name", "never")
    assert proc.wait(timeout=120) == 2, "\n".join(line for _, line in lines)
    proc.reader.join(timeout=30)  # the reader thread has the last lines
    text = [line for _, line in lines]
    assert "Traceback" not in "\n".join(text)
    assert text[-1] == ("raytrain: error: --num-workers 2 needs 2 x (1 CPU) per worker; the "
                        "cluster has 1 CPUs, 0 GPUs in 1 node(s), room for 1 after waiting 4s. "
                        "Lower --num-workers/--cpus-per-worker, or add nodes")
    first = _seen(lines, "waiting for resources: room for 1/2 workers; --wait-timeout 4s")
    assert first is not None and 3 < lines[-1][0] - first < 10  # about --wait-timeout
    assert not (one_cpu_head.base / "runs" / "never").exists()


def test_elastic_run_waits_for_a_node_then_trains(one_cpu_head):
    proc, lines = _start_fit(one_cpu_head, "--num-workers", "2:3", "--wait-timeout",
                             NODE_WAIT, "--epochs", "1", "--name", "grows")
    _add_a_node_once_waiting(one_cpu_head, proc, lines,
                             "waiting for resources: room for 1/2 workers", "grows")


# How long the runs below wait for the node the test adds. On a loaded machine its start can
# take minutes: up to 3 tries, each up to Ray's 30 s and more (LocalCluster._start). Only a
# node that never joins makes a run wait all of it.
NODE_WAIT = "300"


def _add_a_node_once_waiting(cluster: LocalCluster, proc: subprocess.Popen, lines: list,
                             waiting: str, name: str) -> None:
    """When ``waiting`` is printed, add a 1-CPU node; the run must then finish its epoch."""
    session = None
    try:
        deadline = time.monotonic() + 120
        while _seen(lines, waiting) is None:
            assert proc.poll() is None and time.monotonic() < deadline, lines
            time.sleep(0.2)
        session = cluster.add_node()  # one more CPU: room for 2 workers
        assert proc.wait(timeout=int(NODE_WAIT) + 120) == 0, "\n".join(line for _, line in lines)
        rows = report.read_metrics(str(cluster.base / "runs" / name))
        assert [r["epoch"] for r in rows] == [1]
    finally:
        if proc.poll() is None:
            proc.kill()
        if session is not None:
            cluster.stop_session(session)


# ---------------------------------------------------------------------------- a `ray up` head


def _bootstrap_file(home, config_file):
    """~/ray_bootstrap_config.yaml as `ray up` leaves it on the head: the cluster config after
    Ray's own prepare_config (defaults, per-type max_workers), written as JSON."""
    from ray.autoscaler._private.util import prepare_config

    with open(config_file) as f:
        config = prepare_config(yaml.safe_load(f))
    (home / "ray_bootstrap_config.yaml").write_text(json.dumps(config))
    return home / "ray_bootstrap_config.yaml"


def test_bootstrap_config_gives_the_node_types_that_can_add_nodes(tmp_path):
    aws = _bootstrap_file(tmp_path, AWS)
    assert preflight.bootstrap_groups(str(aws)) == [  # not the head's type (max_workers 0)
        {"resources": {"CPU": 4.0, "GPU": 1.0}, "max_count": 8},
        {"resources": {"CPU": 96.0, "GPU": 8.0}, "max_count": 2}]
    config = json.loads(aws.read_text())
    config["max_workers"] = 3  # all types together
    del config["available_node_types"]["gpu.1x-a10g"]["max_workers"]  # defaults to that cap
    config["available_node_types"]["gpu.8x-a100"]["resources"] = {}  # unknown: left out
    aws.write_text(yaml.safe_dump(config))
    assert preflight.bootstrap_groups(str(aws)) == [
        {"resources": {"CPU": 4.0, "GPU": 1.0}, "max_count": 3}]
    # on-prem: one type without resources, always all listed machines: nothing to ask for
    assert preflight.bootstrap_groups(str(_bootstrap_file(tmp_path, ONPREM))
                                   ) == []
    for broken in ("", "[1, 2]", "max_workers: [", "available_node_types: {a: 1}",
                   "available_node_types: {a: {max_workers: x, resources: {CPU: 1}}}",
                   "available_node_types: {a: {max_workers: 1, resources: {CPU: x}}}"):
        aws.write_text(broken)
        assert preflight.bootstrap_groups(str(aws)) == [], broken
    assert preflight.bootstrap_groups(str(tmp_path / "missing.yaml")) == []


# A node type the test's own `add_node` plays the autoscaler for: 1 CPU, 2 of them at most.
ONE_CPU_NODES = {"max_workers": 2, "head_node_type": "head",
                 "available_node_types": {"head": {"resources": {"CPU": 1}, "max_workers": 0},
                                          "cpu": {"resources": {"CPU": 1}, "min_workers": 0,
                                                  "max_workers": 2}}}


def test_without_autoscaler_config_a_run_that_does_not_fit_fails_at_once(one_cpu_head, tmp_path):
    start = time.monotonic()  # a HOME without ~/ray_bootstrap_config.yaml: a fixed cluster
    proc, lines = _start_fit(one_cpu_head, "--num-workers", "2", "--wait-timeout", "120",
                             "--name", "fixed", home=tmp_path)
    assert proc.wait(timeout=60) == 2, "\n".join(line for _, line in lines)
    assert time.monotonic() - start < 30  # mostly the Python and Ray imports on 2 busy cores
    proc.reader.join(timeout=30)  # the reader thread has the last lines
    text = [line for _, line in lines]
    assert not any("waiting for resources" in line for line in text), text
    assert text[-1] == ("raytrain: error: --num-workers 2 needs 2 x (1 CPU) per worker; the "
                        "cluster has 1 CPUs, 0 GPUs in 1 node(s), room for 1. "
                        "Lower --num-workers/--cpus-per-worker, or add nodes")


def test_on_a_ray_up_head_a_run_asks_the_autoscaler_and_waits_for_its_node(one_cpu_head,
                                                                          tmp_path):
    (tmp_path / "ray_bootstrap_config.yaml").write_text(json.dumps(ONE_CPU_NODES))
    proc, lines = _start_fit(one_cpu_head, "--num-workers", "2", "--wait-timeout", NODE_WAIT,
                             "--epochs", "1", "--shared-storage", "--name", "autoscaled",
                             home=tmp_path)  # not elastic: only the node types say "wait"
    _add_a_node_once_waiting(one_cpu_head, proc, lines,  # the test plays the autoscaler
                             "waiting for resources: room for 1/2 workers (autoscaler asked "
                             f"for more nodes); --wait-timeout {NODE_WAIT}s", "autoscaled")
