"""Runs on object storage (--storage-path s3://...), against a real S3-compatible server (moto
in server mode on 127.0.0.1, conftest's ``s3_server``) and real Ray clusters; every file is
read back from the bucket with boto3. gs:// has no offline emulator: not tested here.

    python -m pytest -q tests/test_s3.py
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from raytrain import evaluate, fit, report, storage
from tests.helpers import end_processes, free_port, wait_until

QUICK = ["--dataset", "digits", "--num-workers", "2", "--model", "lenet"]


def _s3():
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


@pytest.fixture
def bucket(s3_server):
    """A new bucket; the runs' local mirrors are removed afterwards."""
    name = f"rt-{secrets.token_hex(4)}"
    _s3().create_bucket(Bucket=name)
    yield name
    shutil.rmtree(storage.mirror_of(f"s3://{name}"), ignore_errors=True)


def _objects(bucket: str, prefix: str = "") -> dict[str, bytes]:
    s3 = _s3()
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def test_tune_on_a_bucket_is_refused_in_one_line(capsys):
    assert fit.main([*QUICK, "--tune", "--storage-path", "s3://b/runs", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytrain: error: --storage-path"), err
    assert "--tune" in err[0]


def test_run_on_s3_then_reuse_refused_finished_evaluate_report(ray_cluster, bucket, capsys):
    uri = f"s3://{bucket}/runs"
    args = [*QUICK, "--epochs", "2", "--storage-path", uri, "--name", "a"]
    assert fit.main(args) == 0
    out = capsys.readouterr().out
    assert f"run directory: {uri}/a" in out and f"weights: {uri}/a/model.pt" in out, out
    saved = _objects(bucket, "runs/a/")
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "learning_curves.png",
                 "model.pt", "checkpoint_epoch_0002/state.pt"):
        assert f"runs/a/{name}" in saved, sorted(saved)
    assert any(k.startswith("runs/a/tensorboard/") for k in saved), sorted(saved)
    assert [json.loads(line)["epoch"] for line in
            saved["runs/a/metrics.jsonl"].decode().splitlines()] == [1, 2]
    assert b"AWS_SECRET" not in b"".join(saved.values())  # no credentials in run files
    from raytrain.models import build_model

    build_model("lenet", 10).load_state_dict(
        torch.load(io.BytesIO(saved["runs/a/model.pt"]), weights_only=True))

    # From another machine: no local mirror. Another config is refused, nothing touched.
    shutil.rmtree(storage.mirror_of(uri), ignore_errors=True)
    assert fit.main([*args, "--lr", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "holds a run with another config (lr: 0.05 -> 0.01)" in err and "--resume" in err
    assert _objects(bucket, "runs/a/") == saved
    assert fit.main(args) == 0  # the same config: finished, nothing re-run
    assert "already finished all 2 epochs" in capsys.readouterr().out

    assert evaluate.main([f"{uri}/a"]) == 0
    assert "test_acc" in capsys.readouterr().out
    assert evaluate.main([f"{uri}/a/checkpoint_epoch_0002"]) == 0
    assert "(360 images, digits, lenet)" in capsys.readouterr().out
    assert evaluate.main([f"{uri}/nope"]) == 2
    assert f"{uri}/nope: no such file or directory" in capsys.readouterr().err
    _s3().delete_object(Bucket=bucket, Key="runs/a/learning_curves.png")
    assert report.main([f"{uri}/a"]) == 0
    assert f"plot: {uri}/a/learning_curves.png" in capsys.readouterr().out
    assert "runs/a/learning_curves.png" in _objects(bucket, "runs/a/")


def _driver(args, env=None):
    return subprocess.Popen([sys.executable, "-m", "raytrain.fit", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def _train_workers(address):
    from ray.util.state import list_actors

    actors = list_actors(address=address, filters=[("class_name", "=", "RayTrainWorker"),
                                                   ("state", "=", "ALIVE")])
    return [psutil.Process(a.pid) for a in actors]


def _rows(bucket: str, key: str) -> list[dict]:
    try:
        body = _s3().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except Exception:  # not there yet
        return []
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def test_killed_worker_then_killed_driver_rerun_resumes_from_the_bucket(ray_cluster, bucket):
    """A SIGKILLed worker is replaced and resumes from the checkpoint in the bucket; then the
    driver is SIGKILLed and the same command, run where there is no local mirror, resumes."""
    address = ray_cluster.address_info["gcs_address"]
    uri = f"s3://{bucket}/runs"
    args = [*QUICK, "--epochs", "10", "--storage-path", uri, "--name", "k",
            "--address", address, "--max-failures", "2"]
    key = "runs/k/metrics.jsonl"
    first = _driver(args)
    try:
        wait_until(lambda: _rows(bucket, key), 180, "an epoch in the bucket", first)
        victims = _train_workers(address)
        assert len(victims) == 2
        victims[-1].send_signal(signal.SIGKILL)
        wait_until(lambda: any(r.get("resumed_from") for r in _rows(bucket, key)), 180,
                   "an epoch of the replaced workers", first)
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
        first.stdout.close()
    rows = _rows(bucket, key)
    assert rows[-1]["epoch"] < 10 and min(r["resumed_from"] for r in rows
                                          if r.get("resumed_from")) >= 1
    wait_until(lambda: not _train_workers(address), 60, "the killed run's workers gone")
    shutil.rmtree(storage.mirror_of(uri), ignore_errors=True)  # resumed from another machine
    second = _driver(args)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    assert "resuming run k from its epoch" in out, out
    assert [r["epoch"] for r in _rows(bucket, key)] == list(range(1, 11))
    assert "runs/k/model.pt" in _objects(bucket, "runs/k/model")


def test_storage_refusing_writes_mid_run_fails_clearly_and_keeps_the_checkpoint(bucket):
    """The run's own cluster and driver talk to a second server on the same (in-process)
    moto state; it is stopped mid-run: every write then fails."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
               PYTHONPATH=os.pathsep.join(sys.path))
    uri = f"s3://{bucket}/runs"
    proc = _driver([*QUICK, "--epochs", "30", "--storage-path", uri, "--name", "f",
                    "--keep-checkpoints", "1"], env=env)
    try:
        wait_until(lambda: len(_rows(bucket, "runs/f/metrics.jsonl")) >= 2, 240,
                   "two epochs in the bucket", proc)
        server.stop()
        out, _ = proc.communicate(timeout=300)
    finally:
        end_processes([p for p in psutil.process_iter() if _in_session(p, proc.pid)])
    assert proc.returncode == 1, out
    errors = [ln for ln in out.splitlines() if ln.startswith("raytrain: error:")]
    assert len(errors) == 1, out
    assert f"--storage-path {uri}" in errors[0] and "rerun the same command" in errors[0], out
    assert "failed" in errors[0] and "AWS Error NETWORK_CONNECTION" in errors[0], out
    kept = re.search(r"the epoch (\d+) checkpoint is intact", errors[0])
    assert kept and int(kept[1]) >= 2, out
    saved = _objects(bucket, "runs/f/")  # through the session's server: the same state
    state = torch.load(io.BytesIO(saved[f"runs/f/checkpoint_epoch_{int(kept[1]):04d}/state.pt"]),
                       weights_only=True)
    assert state["epoch"] == int(kept[1])


def _in_session(p, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid
    except OSError:
        return False
