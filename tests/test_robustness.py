"""Robustness on a real cluster: resources it cannot get, NaN losses, Ctrl-C, bad addresses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import torch

from raytrain import fit


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


def test_nan_loss_stops_the_run_naming_epoch_and_step(ray_cluster, tmp_path, capsys):
    rc = fit.main(["--num-workers", "2", "--dataset", "digits", "--lr", "1e8", "--epochs",
                   "3", "--storage-path", str(tmp_path), "--name", "nan"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "loss became NaN/inf at epoch 1, step" in err and "--nan-policy skip" in err
    with open(tmp_path / "nan" / "metrics.jsonl") as f:
        assert [json.loads(line)["epoch"] for line in f] == [1]  # stopped, not retried
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


def test_ctrl_c_stops_workers_and_leaves_no_ray_processes(tmp_path):
    """The driver starts its own local cluster; SIGINT must take all of it down."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "raytrain.fit", "--num-workers", "1",
                             "--dataset", "synthetic", "--synthetic-size", "16000",
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
    time.sleep(3)
    alive = [p for p in ray_procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline()[:2] for p in alive]
