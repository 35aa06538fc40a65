"""Every advertised flag and entry point runs (issue 22), each small and judged by an outcome:
a metric that moved, a file written, a process alive or gone.

Driven only through the entry points (``raytrain.fit.main``, ``python -m raytrain.report``,
``python -m raytrain.loop`` alone and under ``torchrun``), so the package's layout may change
under them. Training runs share the session's 2-CPU Ray cluster; the --keep-cluster test starts
its own in a PID namespace, where ``ray stop`` can only see the processes that test started.
"""

from __future__ import annotations

import csv
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from raytrain import fit
from raytrain import loop
from raytrain.config import ConfigError
from raytrain.models import SeedCNN
from tests.helpers import checkpoint_dirs, fit_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
DIGITS_TRAIN, DIGITS_TEST = 1437, 360  # the bundled digits split (chance accuracy: 0.10)


_fit = fit_in_process  # raytrain.fit.main here: rc, stdout, stderr


def _jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _state(run_dir) -> dict:
    """The newest checkpoint's training state, read the safe way."""
    return torch.load(os.path.join(run_dir, checkpoint_dirs(run_dir)[-1], "state.pt"),
                      weights_only=True)


def _loop(capsys, *argv: str) -> list[dict]:
    """``python -m raytrain.loop`` in this process (no Ray): its JSON metric lines."""
    capsys.readouterr()
    assert loop.main(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]


# ---------------------------------------------------------------------------- optimizer, lr
# schedule, precision, checkpoint and logging flags: two short 2-worker digits runs


@pytest.fixture(scope="module")
def adamw_run(ray_cluster, tmp_path_factory):
    storage = tmp_path_factory.mktemp("flags")
    rc, out, _ = _fit("--num-workers", "2", "--dataset", "digits", "--epochs", "2",
                      "--batch-size", "128", "--optimizer", "adamw", "--lr", "0.003", "--lr-schedule", "cosine",
                      "--precision", "bf16", "--momentum", "0.8", "--weight-decay", "0.01",
                      "--log-every", "5", "--keep-checkpoints", "1",
                      "--storage-path", str(storage), "--name", "adamw")
    assert rc == 0, out
    return storage / "adamw", out


def test_adamw_with_cosine_schedule_in_bf16_learns(adamw_run):
    run_dir, _ = adamw_run
    rows = _jsonl(run_dir / "metrics.jsonl")
    # Cosine over all steps, stepped per batch: half-way at the end of epoch 1, 0 at the end.
    assert rows[0]["lr"] == pytest.approx(0.003 * (1 + math.cos(math.pi / 2)) / 2, rel=1e-3)
    assert rows[1]["lr"] == pytest.approx(0.0, abs=1e-9)
    assert rows[-1]["test_acc"] > 0.5  # chance is 0.10
    state = _state(run_dir)
    assert state["config"]["precision"] == "bf16" and state["scaler"] is None  # no fp16 scaler
    opt = state["optimizer"]
    assert all({"exp_avg", "exp_avg_sq"} <= set(s) for s in opt["state"].values())  # AdamW's
    group = opt["param_groups"][0]
    assert tuple(group["betas"]) == (0.8, 0.999)  # --momentum is AdamW's beta1
    assert group["weight_decay"] == 0.01


def test_keep_checkpoints_keeps_that_many(adamw_run):
    run_dir, _ = adamw_run
    assert len(checkpoint_dirs(run_dir)) == 1  # 2 epochs, each checkpointed; the default keeps 2


def test_log_every_prints_rank0_loss_lines(adamw_run):
    run_dir, out = adamw_run
    logged = [e["text"] for e in _jsonl(run_dir / "events.jsonl") if e.get("event") == "log"]
    # 1437 images, 719 on rank 0 in 12 equal steps of 60: a line at steps 0, 5 and 10, in the
    # seed's format (tests/test_seed_recipes.py checks the whole line)
    assert [t.split("\t")[0] for t in logged] == [
        f"Train Epoch: {e} [{n}/719 ({p}%)]" for e in (1, 2)
        for n, p in ((0, 0), (300, 42), (600, 83))], logged


def test_report_prints_the_summary_and_redraws_the_plot(adamw_run):
    run_dir, _ = adamw_run
    rows = _jsonl(run_dir / "metrics.jsonl")
    plot = run_dir / "learning_curves.png"
    plot.unlink()
    proc = subprocess.run([sys.executable, "-m", "raytrain.report", str(run_dir)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    best = max(rows, key=lambda r: (r["test_acc"], r["epoch"]))  # the latest of equals
    assert (f"final test_acc {rows[-1]['test_acc']:.4f} (best {best['test_acc']:.4f} at epoch "
            f"{best['epoch']})") in proc.stdout
    assert (f"Accuracy of the network on {rows[-1]['test_count']} test images: "
            f"{100 * rows[-1]['test_acc']:.2f} %") in proc.stdout.replace("on the ", "on ")
    assert len([ln for ln in proc.stdout.splitlines() if ln.split()[:1] in (["1"], ["2"])]) == 2
    assert plot.stat().st_size > 1000


def test_constant_schedule_in_fp16_with_checkpoint_every(ray_cluster, tmp_path):
    # LeNet-5: fp16 autocast on a CPU is slow, and the seed's Net made this test 64-78 s
    rc, out, _ = _fit("--num-workers", "2", "--dataset", "digits", "--epochs", "2",
                      "--model", "lenet", "--lr", "0.05", "--batch-size", "32",
                      "--lr-schedule", "constant", "--precision", "fp16", "--checkpoint-every", "2",
                      "--storage-path", str(tmp_path), "--name", "fp16")
    assert rc == 0, out
    run_dir = tmp_path / "fp16"
    rows = _jsonl(run_dir / "metrics.jsonl")
    assert [r["lr"] for r in rows] == [0.05, 0.05]
    # chance is 0.10; these settings gave 0.74-0.79 on seeds 0-3 (torchrun -m raytrain.loop)
    assert rows[-1]["test_acc"] > 0.3
    assert checkpoint_dirs(run_dir) == ["checkpoint_epoch_0002"]  # never epoch 1's
    state = _state(run_dir)
    assert state["scaler"] is not None and state["scaler"]["scale"] > 0  # GradScaler ran
    group = state["optimizer"]["param_groups"][0]
    assert group["momentum"] == 0.9 and group["nesterov"] and "exp_avg" not in str(
        state["optimizer"]["state"].keys())


# ---------------------------------------------------------------------------- datasets


def write_tiny_cifar100(root, n_train: int = 200, n_test: int = 100, seed: int = 0) -> str:
    """A tiny dataset in CIFAR-100's on-disk format (cifar-100-python/ train, test, meta)."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-100-python")
    os.makedirs(folder, exist_ok=True)

    def split(n: int) -> dict:
        fine = rng.integers(0, 100, n)
        images = rng.integers(0, 256, (n, 3 * 32 * 32)).astype(np.uint8)
        return {"data": images, "fine_labels": fine.tolist(),
                "coarse_labels": (fine // 5).tolist(), "filenames": [f"{i}.png" for i in
                                                                    range(n)]}

    for name, n in (("train", n_train), ("test", n_test)):
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(split(n), f)
    with open(os.path.join(folder, "meta"), "wb") as f:
        pickle.dump({"fine_label_names": [f"fine{i}" for i in range(100)],
                     "coarse_label_names": [f"coarse{i}" for i in range(20)]}, f)
    return folder


def test_cifar100_format_trains_a_100_class_model(ray_cluster, tmp_path):
    write_tiny_cifar100(tmp_path / "data")
    rc, out, _ = _fit("--num-workers", "2", "--dataset", "cifar100", "--data-dir",
                      str(tmp_path / "data"), "--epochs", "1", "--batch-size", "32",
                      "--storage-path", str(tmp_path), "--name", "c100")
    assert rc == 0, out
    rows = _jsonl(tmp_path / "c100" / "metrics.jsonl")
    assert rows[0]["train_count"] == 200 and rows[0]["test_count"] == 100
    assert math.isfinite(rows[0]["train_loss"])
    model = SeedCNN(100)  # strict: a 10-class head would not load
    model.load_state_dict(torch.load(tmp_path / "c100" / "model.pt", weights_only=True))
    assert model.fc2.out_features == 100


def test_augment_flags_change_what_is_trained(capsys):
    args = ["--dataset", "digits", "--epochs", "1", "--batch-size", "256"]
    default, on, off = (_loop(capsys, *args, *extra)[0]["train_loss"]
                        for extra in ([], ["--augment"], ["--no-augment"]))
    assert default == on  # digits: augmented (crop) by default
    assert off != on


def test_synthetic_size_sets_the_training_set(capsys):
    rows = _loop(capsys, "--dataset", "synthetic", "--synthetic-size", "200", "--epochs", "1",
                 "--batch-size", "50")
    assert rows[0]["train_count"] == 200


# ---------------------------------------------------------------------------- Tune


def test_optuna_search_runs_its_trials_one_at_a_time(ray_cluster, tmp_path):
    pytest.importorskip("optuna")  # in the [test] extra: runs wherever the tests are installed
    rc, out, _ = _fit("--tune", "--search", "optuna", "--num-workers", "1", "--dataset",
                      "digits", "--num-samples", "2", "--epochs", "1", "--lr-range",
                      "0.01:0.1", "--batch-sizes", "64,128", "--max-concurrent-trials", "1",
                      "--storage-path", str(tmp_path), "--name", "opt")
    assert rc == 0, out
    exp_dir = tmp_path / "opt"
    with open(exp_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and {r["status"] for r in rows} == {"completed"}
    assert len({(r["lr"], r["batch_size"]) for r in rows}) == 2
    assert all(0.01 <= float(r["lr"]) <= 0.1 and r["batch_size"] in ("64", "128")
               for r in rows)
    spans = []
    for r in rows:  # each trial trained its epoch
        (m,) = _jsonl(exp_dir / "trials" / r["trial_id"] / "metrics.jsonl")
        assert m["train_count"] == DIGITS_TRAIN and m["test_acc"] == float(r["best_test_acc"])
        start = _jsonl(exp_dir / "trials" / r["trial_id"] / "starts.jsonl")[0]["time"]
        spans.append((start, m["first_step_at"] + m["epoch_s"]))
    (a0, a1), (b0, b1) = sorted(spans)
    assert a1 <= b0  # --max-concurrent-trials 1: the second started after the first trained
    (state,) = exp_dir.glob("searcher-state-*.pkl")  # Tune saved the searcher: optuna's
    assert b"optuna" in state.read_bytes()


# ---------------------------------------------------------------------------- config-level


def test_cpus_per_worker_is_what_each_worker_asks_for(ray_cluster, tmp_path):
    rc, _, err = _fit("--num-workers", "2", "--cpus-per-worker", "2", "--dataset", "digits",
                      "--storage-path", str(tmp_path), "--name", "big")
    assert rc == 2 and "needs 2 x (2 CPU)" in err, err


def test_use_gpu_no_gpu_and_debug(tmp_path, capsys):
    base = ["--dry-run", "--dataset", "digits", "--storage-path", str(tmp_path)]
    assert fit.main(base + ["--no-gpu"]) == 0
    assert "workers: 2 x 1 CPU\n" in capsys.readouterr().out
    assert fit.main(base + ["--use-gpu"]) == 0
    assert "workers: 2 x 1 CPU + 1 GPU\n" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--lr"):  # --debug: the traceback, not exit 2
        fit.main(base + ["--lr", "-1", "--debug"])


# ---------------------------------------------------------------------------- --compile


def test_compile_runs_on_cpu():
    """torch.compile on CPU works but is slow to start: inductor generates C++ and gcc builds it
    (measured on this 2-core machine, idle: 58 s for the first epoch of digits, cold cache;
    14 s for the whole run once torch's inductor cache in /tmp holds the kernels)."""
    proc = subprocess.run([sys.executable, "-m", "raytrain.loop", "--compile", "--dataset",
                           "digits", "--epochs", "1", "--batch-size", "64", "--lr", "0.05",
                           "--lr-schedule", "constant"],
                          capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert row["train_count"] == DIGITS_TRAIN and row["test_acc"] > 0.2  # chance is 0.10


# ---------------------------------------------------------------------------- torchrun


def test_loop_under_torchrun_trains_on_two_ranks(tmp_path):
    proc = subprocess.run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node",
                           "2", "-m", "raytrain.loop", "--dataset", "digits", "--epochs", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [r["epoch"] for r in rows] == [1, 2]  # rank 0 alone prints
    # Each rank trains on its half; rank 0 counts the whole set only by all-reducing with rank
    # 1 (without the process group it would count its ~719).
    assert all(r["train_count"] == DIGITS_TRAIN and r["test_count"] == DIGITS_TEST
               for r in rows)
    assert rows[-1]["test_acc"] > 0.2


# ---------------------------------------------------------------------------- --keep-cluster

KEEP_CLUSTER = textwrap.dedent("""
    # PID 1 of a new PID namespace, /tmp/ray a private tmpfs: `ray stop` sees only this.
    import json, os, re, subprocess, sys, time, urllib.request
    import psutil

    RAY = os.path.join(os.path.dirname(sys.executable), "ray")
    RAY_DAEMONS = ("gcs_server", "raylet")

    def ray_daemons():
        # Orphans re-parent to this PID 1, which does not reap them: zombies are gone too.
        return sorted(p.info["name"] for p in psutil.process_iter(["name", "status"])
                      if p.info["name"] in RAY_DAEMONS
                      and p.info["status"] != psutil.STATUS_ZOMBIE)

    def answers(url):
        req = urllib.request.Request(url)
        token = os.path.expanduser("~/.ray/auth_token")
        if os.path.exists(token):
            req.add_header("Authorization", "Bearer " + open(token).read().strip())
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except OSError as err:
            return repr(err)

    result = {}
    try:
        fit = subprocess.run([sys.executable, "-m", "raytrain.fit", "--keep-cluster",
                              "--verbose", *sys.argv[1:]], capture_output=True, text=True,
                             timeout=300)
        result["fit_rc"], result["fit_out"] = fit.returncode, fit.stdout + fit.stderr
        found = re.search(r"Ray dashboard: (http://[0-9.:]+)", fit.stdout)
        if found is None:  # why the kept cluster has no dashboard, for the failure message
            logs = "/tmp/ray/session_latest/logs/"
            for name in ("dashboard.log", "dashboard.err"):
                if os.path.exists(logs + name):
                    result[name] = open(logs + name).read()[-2000:]
        url = found.group(1)
        result["after_run"] = {"daemons": ray_daemons(), "dashboard": answers(url)}
        stop = subprocess.run([RAY, "stop"], capture_output=True, text=True, timeout=120)
        result["stop_rc"] = stop.returncode
        deadline = time.monotonic() + 15
        while ray_daemons() and time.monotonic() < deadline:
            time.sleep(0.5)
        result["after_stop"] = {"daemons": ray_daemons(), "dashboard": answers(url)}
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        print("RESULT " + json.dumps(result))
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare: `ray stop` must not reach other clusters")
def test_keep_cluster_outlives_the_run_until_ray_stop(tmp_path):
    script = tmp_path / "keep_cluster.py"
    script.write_text(KEEP_CLUSTER)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    # The namespace's PID 1 is the shell; when it exits the kernel ends whatever is left.
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
         'mkdir -p /tmp/ray && mount -t tmpfs raytrain-keep /tmp/ray && exec "$@"', "sh",
         sys.executable, str(script), "--num-workers", "1", "--dataset", "digits", "--epochs",
         "1", "--storage-path", str(tmp_path / "runs"), "--name", "kept"],
        capture_output=True, text=True, timeout=480, cwd=ROOT, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(line[0].removeprefix("RESULT "))
    assert result["fit_rc"] == 0, result["fit_out"][-3000:]
    assert "it stays up after the run: stop it with `ray stop`" in result["fit_out"], result
    assert "(RayTrainWorker pid=" in result["fit_out"]  # --verbose: the workers' own output
    assert result["after_run"] == {"daemons": ["gcs_server", "raylet"], "dashboard": 200}
    assert result["stop_rc"] == 0
    assert result["after_stop"]["daemons"] == [] and result["after_stop"]["dashboard"] != 200
    assert _jsonl(tmp_path / "runs" / "kept" / "metrics.jsonl")[0]["epoch"] == 1
