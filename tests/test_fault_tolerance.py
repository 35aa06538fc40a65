"""Checkpoints, resume and failures, with real process kills on a real local Ray cluster."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from raytrain import fit
from raytrain.config import TrainConfig
from raytrain.worker.loop import Worker, run_worker
from tests.helpers import checkpoint_dirs, metrics, wait_for_epoch, wait_until

# ~2 s epochs on this 2-core machine (16,000 images took 11 s: 2026-12-06): long enough to
# kill a process mid-run, which the tests do within a second of an epoch's end.
SLOW = ["--dataset", "synthetic", "--synthetic-size", "3200", "--batch-size", "128",
        "--num-workers", "2", "--seed", "3"]


def _driver(address, args, **kw):
    return subprocess.Popen([sys.executable, "-m", "raytrain.fit", "--address", address, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _train_workers(address):
    """This cluster's live Ray Train worker processes, found through Ray's state API."""
    from ray.util.state import list_actors

    actors = list_actors(address=address, filters=[("class_name", "=", "RayTrainWorker"),
                                  ("state", "=", "ALIVE")])
    return [psutil.Process(a.pid) for a in actors]


@pytest.fixture(scope="module")
def address(ray_cluster):
    return ray_cluster.address_info["gcs_address"]


def test_killed_worker_is_replaced_and_run_resumes_from_checkpoint(address, tmp_path):
    run_dir = tmp_path / "ft"
    proc = _driver(address, [*SLOW, "--epochs", "5", "--max-failures", "2",
                             "--storage-path", str(tmp_path), "--name", "ft"])
    wait_for_epoch(run_dir, 2, proc)
    victims = _train_workers(address)
    assert len(victims) == 2
    victims[-1].send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert [r["epoch"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]
    resumed = [r["resumed_from"] for r in metrics(run_dir) if r.get("resumed_from")]
    assert resumed and resumed[0] >= 2, out  # not restarted from scratch
    assert "worker failure" in out and f"resumed from the epoch {resumed[0]} checkpoint" in out


def test_more_failures_than_allowed_fail_clearly(address, tmp_path):
    proc = _driver(address, [*SLOW, "--epochs", "6", "--max-failures", "0",
                             "--storage-path", str(tmp_path), "--name", "ft0"])
    wait_for_epoch(tmp_path / "ft0", 1, proc)
    _train_workers(address)[0].send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "raytrain: error: training failed" in out


def test_a_killed_controller_leaves_no_placement_group_on_a_cluster_that_outlives_it(
        address, tmp_path):
    """The suite's held session-cluster CPU, at its source: Ray removes a placement group once
    its creator (the Train controller) *and* the creator's job (the driver) are dead, so a
    controller that dies while the driver goes on (a notebook, this suite's shared cluster,
    an in-process run) left its workers' group holding their CPUs for good. The run must
    fail in one line and remove what its controller left."""
    import threading

    import ray
    from ray.util.state import list_actors

    codes = []
    run = threading.Thread(target=lambda: codes.append(fit.main(
        [*SLOW, "--epochs", "20", "--storage-path", str(tmp_path), "--name", "ctl"])))
    run.start()
    try:
        wait_for_epoch(tmp_path / "ctl", 1, None, timeout=240)
        # this run's: the newest live controller (an earlier test's may still be ending)
        controller = max(list_actors(address=address, filters=[
            ("class_name", "=", "TrainController"), ("state", "=", "ALIVE")]),
            key=lambda a: psutil.Process(a.pid).create_time())
        os.kill(controller.pid, signal.SIGKILL)
    finally:
        run.join(timeout=180)
    assert codes == [1]  # a failed run, said in one line (fit.main printed it)
    wait_until(lambda: ray.available_resources().get("CPU", 0) == 2, 60,
               "the killed controller's workers' CPUs free again")


def test_killed_driver_rerun_continues_and_ends_bit_identical(address, tmp_path):
    # Two thirds of SLOW's epoch: three 4-epoch runs; two epochs still outlast the kill's polling
    args = [*SLOW, "--synthetic-size", "2000", "--epochs", "4", "--storage-path", str(tmp_path)]
    straight = _driver(address, [*args, "--name", "straight"])
    out, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0, out

    first = _driver(address, [*args, "--name", "again"])
    wait_for_epoch(tmp_path / "again", 2, first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    # Ray reaps the dead driver's actors: its workers' CPUs are free for the next run
    wait_until(lambda: not _train_workers(address), 60, "the killed run's workers gone")
    second = _driver(address, [*args, "--name", "again"])
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    assert "resuming run again from its epoch" in out
    assert [r["epoch"] for r in metrics(tmp_path / "again")] == [1, 2, 3, 4]
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "again" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_in_one_process_is_bit_identical():
    """The per-worker loop alone (no Ray): 2 epochs + resume == 4 straight epochs."""
    cfg = TrainConfig.from_flat({"dataset": "digits", "num_workers": 1, "epochs": 4,
                                 "batch_size": 64, "seed": 5})
    worker = Worker(0, 0, 1, torch.device("cpu"))
    states, resumed = {}, {}  # saved as the Ray reporter does: serialized at report time
    run_worker(cfg, worker, lambda m, s: states.__setitem__(m["epoch"], _roundtrip(s)))
    state2 = torch.load(states[2], weights_only=True)
    run_worker(cfg, worker, lambda m, s: resumed.__setitem__(m["epoch"], _roundtrip(s)),
               resume=state2)
    assert sorted(resumed) == [3, 4]
    a = torch.load(states[4], weights_only=True)["model"]
    b = torch.load(resumed[4], weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("schedule", ["onecycle", "cosine"])
def test_resume_with_more_epochs_follows_the_new_schedule(schedule):
    """--resume with a larger --epochs: the schedule is this run's length (OneCycleLR kept
    the old one and failed past its last step)."""
    flat = {"dataset": "digits", "num_workers": 1, "epochs": 1, "batch_size": 256,
            "model": "lenet", "lr_schedule": schedule}
    worker = Worker(0, 0, 1, torch.device("cpu"))
    states, more = {}, {}
    run_worker(TrainConfig.from_flat(flat), worker,
               lambda m, s: states.__setitem__(m["epoch"], _roundtrip(s)))
    run_worker(TrainConfig.from_flat({**flat, "epochs": 3}), worker,
               lambda m, s: more.__setitem__(m["epoch"], m),
               resume=torch.load(states[1], weights_only=True))
    assert sorted(more) == [2, 3] and more[3]["lr"] < more[2]["lr"] < flat.get("lr", 0.05)


def _roundtrip(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_reused_name_with_other_config_is_refused_then_fresh_restarts(ray_cluster, tmp_path,
                                                                      capsys):
    args = ["--dataset", "digits", "--epochs", "2", "--storage-path", str(tmp_path),
            "--name", "same"]
    assert fit.main(args) == 0
    run_dir = tmp_path / "same"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert fit.main([*args, "--lr", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "holds a run with another config (lr: 0.05 -> 0.01)" in err and "--resume" in err
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert before == after  # nothing saved was touched
    assert fit.main(args) == 0  # same config: already finished, nothing re-run
    assert "already finished all 2 epochs" in capsys.readouterr().out
    assert fit.main([*args, "--lr", "0.01", "--fresh"]) == 0
    rows = metrics(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0].get("resumed_from") == 0


def test_rerun_after_ctrl_c_says_where_it_resumes_and_keeps_what_it_should(ray_cluster,
                                                                          tmp_path, capsys):
    """A Ctrl-C between rank 0 writing checkpoint_epoch_0003 and Ray registering it leaves a
    directory Ray never resumes from: the re-run announces the epoch the workers really
    resume from, calls nothing a recovery, and ends with --keep-checkpoints directories."""
    args = ["--dataset", "digits", "--lr-schedule", "constant", "--storage-path", str(tmp_path),
            "--name", "cut", "--keep-checkpoints", "1"]
    assert fit.main([*args, "--epochs", "2"]) == 0
    run_dir = tmp_path / "cut"
    assert sorted(os.listdir(run_dir / "checkpoint_epoch_0002"))  # Ray's newest
    shutil.copytree(run_dir / "checkpoint_epoch_0002", run_dir / "checkpoint_epoch_0003")
    capsys.readouterr()
    assert fit.main([*args, "--epochs", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resuming run cut from its epoch 2 checkpoint (2 epochs to go)" in out, out
    assert "recovered" not in out, out
    assert [r["epoch"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    assert checkpoint_dirs(run_dir) == ["checkpoint_epoch_0004"]
    shutil.copytree(run_dir / "checkpoint_epoch_0004", run_dir / "checkpoint_epoch_0005")
    from raytrain.driver.run import prune_checkpoints

    prune_checkpoints(str(run_dir))  # what the driver does when a run ends, Ctrl-C or not
    assert checkpoint_dirs(run_dir) == ["checkpoint_epoch_0004"]


def test_corrupt_and_malicious_checkpoints_are_refused(tmp_path, capsys):
    from raytrain import evaluate

    good = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, good)
    (tmp_path / "trunc.pt").write_bytes(good.read_bytes()[:200])
    assert evaluate.main([str(tmp_path / "trunc.pt"), "--dataset", "digits"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raytrain: error: ") and "trunc.pt" in err and "\n" not in err

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": Evil()}, tmp_path / "evil.pt")
    assert evaluate.main([str(tmp_path / "evil.pt"), "--dataset", "digits"]) == 2
    err = capsys.readouterr().err
    assert "evil.pt" in err and "refused" in err
    assert not marker.exists()


def test_evaluate_without_dataset_says_what_is_wrong_with_the_path(tmp_path, capsys):
    """No --dataset, no config.yaml beside the path: each failure is its own line naming the
    path, and a training checkpoint moved out of its run directory uses its own config."""
    import pickle

    from raytrain import checkpoint, evaluate

    cfg = TrainConfig.from_flat({"dataset": "digits", "model": "lenet", "num_workers": 1,
                                 "epochs": 1, "batch_size": 64, "seed": 1})
    states = {}
    run_worker(cfg, Worker(0, 0, 1, torch.device("cpu")),
               lambda m, s: states.update({"state": s, "acc": m["test_acc"]}))
    moved = tmp_path / "moved_ckpt"
    moved.mkdir()
    checkpoint.save(states["state"], str(moved))
    torch.save(states["state"]["model"], tmp_path / "model_alone.pt")
    whole = (moved / "state.pt").read_bytes()
    (tmp_path / "trunc.pt").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    (tmp_path / "empty").mkdir()
    cases = {"nope": "nope: no such file or directory",
             "empty": "empty: not a run or checkpoint directory (no model.pt or state.pt",
             "notes.txt": "notes.txt: cannot load checkpoint: not a file torch.save wrote",
             "trunc.pt": "trunc.pt: cannot load checkpoint: it is truncated",
             "model_alone.pt": "model_alone.pt: no config.yaml beside it and a plain "
                               "state_dict carries no config: pass --dataset"}
    for name, expected in cases.items():
        assert evaluate.main([str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("raytrain: error: ") and expected in err, err
    for path in (moved, moved / "state.pt"):
        assert evaluate.main([str(path)]) == 0
        out = capsys.readouterr().out
        assert f"test_acc {states['acc']:.4f}" in out and "digits, lenet" in out, out
    # A plain pickle: raytrain's refusal alone, no torch.load warning before it.
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump({"w": {1, 2}}, f, protocol=4)
    proc = subprocess.run([sys.executable, "-m", "raytrain.evaluate", str(tmp_path / "plain.pkl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "plain.pkl: cannot load checkpoint: it holds Python objects" in proc.stderr
