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


def test_pbt_search_on_a_bucket_is_refused_in_one_line(capsys):
    """PBT hands training state between trials through a trial's local disk (tune/pbt.py)."""
    assert fit.main([*QUICK, "--tune", "--scheduler", "pbt", "--storage-path", "s3://b/runs",
                     "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytrain: error: --scheduler: got 'pbt'"), err
    assert "asha or none with a bucket --storage-path" in err[0]


def _csv(data: bytes) -> list[dict[str, str]]:
    import csv

    return list(csv.DictReader(io.StringIO(data.decode())))


def test_search_on_s3_then_rerun_reuse_refused_fresh_evaluate_report(ray_cluster, bucket,
                                                                      capsys):
    """A 2-trial grid on a bucket, one trial failing on its NaN loss: raytrain's files, each
    trial's run and Tune's own state in the bucket; re-run from a machine without the mirror:
    nothing re-run; another search under the name refused with the bucket unchanged; --fresh
    deletes it and starts over."""
    uri = f"s3://{bucket}/runs"
    args = ["--tune", "--num-workers", "1", "--dataset", "digits", "--model", "lenet",
            "--epochs", "2", "--lr-range", "0.05,10000", "--num-samples", "1", "--batch-sizes",
            "128", "--scheduler", "none", "--storage-path", uri, "--name", "s"]
    assert fit.main(args) == 0
    out = capsys.readouterr().out
    assert f"results: {uri}/s/results.csv, plot: {uri}/s/tune.png" in out, out
    assert f"weights: {uri}/s/model.pt" in out, out
    saved = _objects(bucket, "runs/s/")
    for name in ("config.yaml", "results.csv", "tune.png", "model.pt", "tuner.pkl"):
        assert f"runs/s/{name}" in saved, sorted(saved)
    assert any(re.fullmatch(r"runs/s/experiment_state-.*\.json", k) for k in saved), sorted(saved)
    rows = {r["trial_id"]: r for r in _csv(saved["runs/s/results.csv"])}
    ok, nan = sorted(rows.values(), key=lambda r: float(r["lr"]))
    assert (ok["status"], nan["status"]) == ("completed", "failed") and "NaN" in nan["error"]
    for r in rows.values():
        trial = f"runs/s/trials/{r['trial_id']}/"
        metrics = [json.loads(line) for line in saved[trial + "metrics.jsonl"].splitlines()]
        assert [m["epoch"] for m in metrics] == ([1, 2] if r is ok else [1])
        assert trial + "config.yaml" in saved and trial + "starts.jsonl" in saved
    trial = f"runs/s/trials/{ok['trial_id']}/"
    metrics = [json.loads(line) for line in saved[trial + "metrics.jsonl"].splitlines()]
    assert float(ok["best_test_acc"]) == max(m["test_acc"] for m in metrics)
    assert ok["checkpoint"].startswith(f"s3://{bucket}/{trial}train/checkpoint_epoch_"), ok
    assert ok["checkpoint"].removeprefix(f"s3://{bucket}/") + "/state.pt" in saved, ok
    events = saved[f"runs/s/trials/{nan['trial_id']}/events.jsonl"].decode()  # by the driver
    assert [json.loads(line)["event"] for line in events.splitlines()][-1] == "trial_failed"
    everything = b"".join(saved.values())  # Tune's pickles too: no credential in any object
    assert b"AWS_SECRET" not in everything
    assert os.environ["AWS_SECRET_ACCESS_KEY"].encode() not in everything
    from raytrain.models import build_model

    build_model("lenet", 10).load_state_dict(
        torch.load(io.BytesIO(saved["runs/s/model.pt"]), weights_only=True))

    # From another machine: no mirror. The same command resumes the finished search.
    shutil.rmtree(storage.mirror_of(uri), ignore_errors=True)
    assert fit.main(args) == 0
    out = capsys.readouterr().out
    assert f"resuming the search in {uri}/s" in out and "started" not in out, out
    assert "best: trial" in out
    again = {r["trial_id"]: r for r in _csv(_objects(bucket, "runs/s/results.csv")
                                             ["runs/s/results.csv"])}
    assert {k: v["epochs_run"] for k, v in again.items()} == {
        k: v["epochs_run"] for k, v in rows.items()}

    # Another search under the name: refused, nothing in the bucket touched.
    shutil.rmtree(storage.mirror_of(uri), ignore_errors=True)
    before = _objects(bucket, "runs/s/")
    assert fit.main([*args, "--lr-range", "0.01,0.1"]) == 2
    err = capsys.readouterr().err
    assert "holds a search with other settings (lr_range: '0.05,10000' -> '0.01,0.1')" in err
    assert "--resume" in err
    assert _objects(bucket, "runs/s/") == before

    assert evaluate.main([f"{uri}/s"]) == 0  # the best trial's model.pt
    assert "(360 images, digits, lenet)" in capsys.readouterr().out
    assert report.main([f"{uri}/s"]) == 0
    out = capsys.readouterr().out
    assert all(trial_id in out for trial_id in rows) and "best: trial" in out, out
    first = sorted(rows)[0]
    assert report.main([f"{uri}/s/trials/{first}"]) == 0  # a trial is a run
    assert f"plot: {uri}/s/trials/{first}/learning_curves.png" in capsys.readouterr().out

    # --fresh: the old search is deleted from the bucket, a new one run.
    assert fit.main([*args, "--lr-range", "0.05", "--epochs", "1", "--fresh"]) == 0
    capsys.readouterr()
    fresh = _objects(bucket, "runs/s/")
    (new,) = _csv(fresh["runs/s/results.csv"])
    assert new["trial_id"] not in rows and new["status"] == "completed"
    assert not [k for k in fresh if any(f"/{trial_id}/" in k for trial_id in rows)]


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
