"""The Tune layer on a real 2-CPU Ray cluster: ASHA stops weak trials, PBT exploits, a NaN trial
fails alone, the search resumes; settings and PBT's optimizer re-targeting without Ray."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch
import yaml

from raytrain import checkpoint, fit, tune as tuning
from raytrain.config import ConfigError, TrainConfig
from raytrain.files import read_jsonl
from raytrain.models import SeedCNN

DIGITS = ["--tune", "--num-workers", "1", "--dataset", "digits"]


def _search(storage, name, *flags):
    return fit.main(DIGITS + ["--storage-path", str(storage), "--name", name, *flags])


def _results(exp_dir):
    return {r["trial_id"]: r for r in tuning.read_results(str(exp_dir))}


def _held_after_cleanup(wait_s=15):
    """The bundles of the placement groups still held once Tune's asynchronous removal of its
    trial groups had ``wait_s`` to finish; [] when the cluster's CPUs are all free again."""
    import ray

    def held():
        return [pg["bundles"] for pg in ray.util.placement_group_table().values()
                if pg["state"] != "REMOVED"]

    deadline = time.monotonic() + wait_s
    while held() and time.monotonic() < deadline:
        time.sleep(0.5)
    return held()


# ---------------------------------------------------------------------------- ASHA


@pytest.fixture(scope="module")
def asha(ray_cluster, tmp_path_factory):
    storage = tmp_path_factory.mktemp("tune")
    started, out = time.monotonic(), io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = _search(storage, "asha", "--num-samples", "4", "--epochs", "4", "--grace-period",
                     "1", "--reduction-factor", "2")
    print(out.getvalue())
    return rc, storage, time.monotonic() - started, out.getvalue()


def test_asha_search_stops_weak_trials_and_writes_results(asha, capsys):
    rc, storage, _, _ = asha
    assert rc == 0
    rows = _results(storage / "asha")
    assert len(rows) == 4
    assert {r["status"] for r in rows.values()} <= {"completed", "stopped"}
    stopped = [r for r in rows.values() if r["status"] == "stopped"]
    assert stopped and all(int(r["epochs_run"]) < 4 for r in stopped)
    assert any(r["status"] == "completed" and int(r["epochs_run"]) == 4 for r in rows.values())
    best = [float(r["best_test_acc"]) for r in rows.values()]
    assert max(best) > min(best)
    assert len({(r["lr"], r["batch_size"]) for r in rows.values()}) == 4
    assert os.path.getsize(storage / "asha" / "tune.png") > 10_000
    for trial_id, r in rows.items():  # each trial: its own run dir, one metrics row per epoch
        metrics = read_jsonl(storage / "asha" / "trials" / trial_id / "metrics.jsonl")
        assert [m["epoch"] for m in metrics] == list(range(1, int(r["last_epoch"]) + 1))
        assert float(r["best_test_acc"]) == max(m["test_acc"] for m in metrics)


def test_asha_best_trial_checkpoint_and_weights(asha):
    _, storage, _, _ = asha
    rows = _results(storage / "asha")
    best = max(rows.values(), key=lambda r: float(r["best_test_acc"]))
    assert best["checkpoint"].startswith(str(storage / "asha" / "trials" / best["trial_id"]))
    assert os.path.exists(os.path.join(best["checkpoint"], "state.pt"))
    SeedCNN(10).load_state_dict(torch.load(storage / "asha" / "model.pt", weights_only=True))


def test_asha_console_plot_and_records_say_only_what_happened(asha):
    """Tune's own boxed table and TensorBoard hint stay off the console (--verbose shows them);
    no trial that completed or was stopped is recorded as failed; tune.png's legend has no
    "failed" when none failed and its epoch axis is in whole epochs."""
    from raytrain.tune import results

    rc, storage, _, out = asha
    assert rc == 0
    assert "Configuration for experiment" not in out and "tensorboard --logdir" not in out, out
    exp_dir = storage / "asha"
    rows = _results(exp_dir)
    for trial_id, r in rows.items():
        events = exp_dir / "trials" / trial_id / "events.jsonl"
        recorded = read_jsonl(events) if events.exists() else []
        assert not [e for e in recorded if e["event"] == "trial_failed"], (r["status"], recorded)
        assert r["checkpoint"].endswith(f"checkpoint_epoch_{int(r['best_epoch']):04d}"), r
    typed = [{**r, "lr": float(r["lr"]), "batch_size": int(r["batch_size"]),
              "best_test_acc": float(r["best_test_acc"])} for r in rows.values()]
    fig = results.figure(str(exp_dir), typed)
    ax_curve, ax_lr = fig.axes[:2]
    assert "failed" not in [t.get_text() for t in ax_lr.get_legend().get_texts()]
    ticks = [t for t in ax_curve.get_xticks() if 1 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_best_epoch_and_best_checkpoint_break_ties_alike(tmp_path):
    """Equal test_acc at epochs 2 and 3: the summary, results.csv's best_epoch and its
    checkpoint all name epoch 3, the one Ray Train keeps."""
    import pandas as pd

    from raytrain import report
    from raytrain.tune import results

    paths = []
    for epoch in (1, 2, 3):
        path = tmp_path / f"checkpoint_epoch_{epoch:04d}"
        path.mkdir()
        torch.save({"w": torch.zeros(1)}, path / "state.pt")
        paths.append(str(path))
    rows = [{"epoch": e, "test_acc": a, "test_loss": 1.0} for e, a in ((1, 0.5), (2, 0.9),
                                                                         (3, 0.9))]
    reports = pd.DataFrame({"epoch": [1, 2, 3], "test_acc": [0.5, 0.9, 0.9],
                            "checkpoint_path": paths})
    assert results.best_checkpoint(reports) == paths[2]
    assert "(best 0.9000 at epoch 3)" in report.accuracy_lines(rows)[0]


def test_stopped_trials_give_their_cpus_back(asha):
    """Tune ends a stopped trial's process; its workers' placement group must not leak."""
    import ray

    assert _held_after_cleanup() == []
    assert ray.available_resources().get("CPU", 0) == 2


def test_the_reaper_finds_a_group_its_dead_controller_never_finished_starting(ray_cluster,
                                                                              tmp_path):
    """A Train controller whose worker died first (Ctrl-C) retries, and dies while its new
    worker group starts: nothing recorded that group. The reaper finds it by its creator."""
    import ray
    from ray.util.placement_group import placement_group

    @ray.remote(num_cpus=0)
    class Controller:
        def start_worker_group(self, record):
            tuning.RecordPlacementGroup(record).before_worker_group_start(None)
            return placement_group([{"CPU": 1}]).id.hex()

    trial_dir = tmp_path / "trials" / "t1"
    trial_dir.mkdir(parents=True)
    controller = Controller.remote()
    pg = ray.get(controller.start_worker_group.remote(str(trial_dir / tuning.PG_FILE)))
    reaper = tuning.PlacementGroupReaper(str(tmp_path / "trials"))
    assert reaper.pending() == [pg]
    assert reaper.sweep() == 0  # its controller is alive: a running trial's group stays
    ray.kill(controller)
    deadline = time.monotonic() + 15
    while reaper.pending() and time.monotonic() < deadline:
        reaper.sweep()
        time.sleep(0.2)
    assert reaper.pending() == []
    assert _held_after_cleanup() == []


def test_rerunning_the_command_resumes_the_finished_search(asha, capsys):
    _, storage, _, _ = asha
    before = _results(storage / "asha")
    capsys.readouterr()
    rc = _search(storage, "asha", "--num-samples", "4", "--epochs", "4", "--grace-period", "1",
                 "--reduction-factor", "2")
    out = capsys.readouterr().out
    assert rc == 0
    assert "resuming the search" in out and "started" not in out  # nothing re-run
    after = _results(storage / "asha")
    assert after.keys() == before.keys()
    assert [a["epochs_run"] for a in after.values()] == [b["epochs_run"] for b in before.values()]
    assert "best: trial" in out


def test_a_changed_search_in_the_same_directory_is_refused(asha, capsys):
    _, storage, _, _ = asha
    rc = _search(storage, "asha", "--num-samples", "4", "--epochs", "4", "--lr-range", "0.1:1")
    assert rc == 2
    assert "--resume" in capsys.readouterr().err


# ---------------------------------------------------------------------------- failures, PBT


def test_an_interrupted_search_resumes_where_it_stopped(ray_cluster, tmp_path, capsys):
    """Ctrl-C after the first epoch; the same command then finishes the search, the started
    trials continuing from their checkpoints (Tuner.restore + Train's own resume)."""
    import signal
    import threading

    trials = tmp_path / "intr" / "trials"

    def interrupt_after_first_epoch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = list(trials.glob("*/metrics.jsonl")) if trials.exists() else []
            # Only while Tune's handler is installed: a bare SIGINT would stop pytest.
            if done and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    flags = ["--num-samples", "2", "--epochs", "3", "--scheduler", "none",
             "--batch-sizes", "128"]
    threading.Thread(target=interrupt_after_first_epoch, daemon=True).start()
    assert _search(tmp_path, "intr", *flags) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert _held_after_cleanup() == []  # nor a group a dying controller had just made
    assert _search(tmp_path, "intr", *flags) == 0
    rows = _results(tmp_path / "intr")
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows.values())
    restarted = [tid for tid in rows if len(read_jsonl(trials / tid / "starts.jsonl")) == 2]
    assert restarted
    for tid in restarted:
        metrics = read_jsonl(trials / tid / "metrics.jsonl")
        assert [m["epoch"] for m in metrics] == [1, 2, 3]
        # Not from scratch: epoch 1 was trained before the second start, never again. (The
        # rest came from a resume, or, when Ctrl-C reached the trial's Train run late, from
        # the first run finishing: the second then had nothing left to train.)
        second_start = read_jsonl(trials / tid / "starts.jsonl")[1]["time"]
        assert metrics[0]["first_step_at"] < second_start




def test_a_nan_trial_fails_alone_and_is_reported(ray_cluster, tmp_path, capsys):
    rc = _search(tmp_path, "nan", "--lr-range", "0.05,10000", "--batch-sizes", "64",
                 "--num-samples", "1", "--epochs", "2", "--scheduler", "none")
    out = capsys.readouterr().out
    assert rc == 0
    rows = sorted(_results(tmp_path / "nan").values(), key=lambda r: float(r["lr"]))
    assert [r["status"] for r in rows] == ["completed", "failed"]
    assert "NaN" in rows[1]["error"] and rows[0]["error"] == ""
    assert f"trial {rows[1]['trial_id']} failed: loss became NaN" in out
    assert f"best: trial {rows[0]['trial_id']}" in out


def test_pbt_exploits_another_trials_checkpoint(ray_cluster, tmp_path):
    """lr 0.0003 lags far behind lr 0.05: PBT copies the leader's checkpoint into it."""
    # PBT exploits only while both trials run: the weak one must report after the leader has
    # saved a checkpoint at a perturbation, and before the leader finishes. So both trials'
    # workers must fit on the cluster at once: with a CPU still held (a placement group an
    # earlier search leaked), they run one after the other. Batches of 16 (4x the steps of 64,
    # ~1 s epochs here; lr 0.05 still learns, 0.0003 stays near chance) leave the two starts a
    # few seconds of slack: at batch 64 (~2.5 s for 5 epochs), first steps 1.5 s apart gave no
    # exploit. How Tune schedules the two trials on 2 shared CPUs still varies, so a search
    # without one is run again, twice at most; each search must finish cleanly.
    assert _held_after_cleanup() == []
    gaps = []
    for attempt in range(3):
        name = f"pbt{attempt}"
        rc = _search(tmp_path, name, "--scheduler", "pbt", "--lr-range", "0.05,0.0003",
                     "--batch-sizes", "16", "--num-samples", "1", "--epochs", "5",
                     "--perturbation-interval", "1")
        assert rc == 0
        rows = _results(tmp_path / name)
        # A clone of the leader's last epoch (it had finished) leaves nothing to train: no
        # resume to check, so it does not count.
        exploits = [(tid, s) for tid in rows
                    for s in read_jsonl(tmp_path / name / "trials" / tid / "starts.jsonl")
                    if s["from_trial"] not in (None, tid) and s["from_epoch"] < 5]
        if exploits:
            break
        firsts = [read_jsonl(tmp_path / name / "trials" / tid / "metrics.jsonl")[0]["first_step_at"]
                  for tid in rows]
        gaps.append(round(max(firsts) - min(firsts), 1))
    assert exploits, ("no trial resumed from another trial's checkpoint in 3 searches; "
                      f"seconds between the trials' first steps: {gaps}")
    trial_id, start = min(exploits, key=lambda e: e[1]["from_epoch"])
    assert start["from_trial"] in rows and start["from_trial"] in rows[trial_id]["started_from"]
    # The new Train run started from the donor's training state at that epoch...
    state = checkpoint.load_state(str(tmp_path / name / "trials" / trial_id / "starts" /
                                      start["segment"]))
    assert state["epoch"] == start["from_epoch"]
    # ...and resumed there: its first epoch is the next one.
    metrics = {m["epoch"]: m for m in read_jsonl(tmp_path / name / "trials" / trial_id /
                                              "metrics.jsonl")}
    assert metrics[start["from_epoch"] + 1].get("resumed_from") == start["from_epoch"]


# ---------------------------------------------------------------------------- without Ray


def _cfg(**flat):
    return TrainConfig.from_flat({"dataset": "digits", "num_workers": 1, **flat})


def _race(scheduler, epochs=4):
    """Two trials through ``scheduler`` the way Tune feeds it: "slow" reaches every rung first
    and never learns; "fast" arrives second and does. Returns the decisions per epoch."""
    from ray.tune.experiment import Trial

    slow, fast = (Trial("run_trial", trial_id=i, stub=True) for i in ("slow", "fast"))
    for trial in (slow, fast):
        scheduler.on_trial_add(None, trial)
    decisions = []
    for epoch in range(1, epochs + 1):
        decisions.append((scheduler.on_trial_result(None, slow, {"epoch": epoch,
                                                                 "test_loss": 2.30}),
                          scheduler.on_trial_result(None, fast, {"epoch": epoch,
                                                                 "test_loss": 2.0 / epoch})))
    return decisions


def test_asha_late_check_stops_a_trial_that_won_the_race_to_a_rung():
    from ray.tune.schedulers import ASHAScheduler

    kwargs = dict(time_attr="epoch", metric="test_loss", mode="min", max_t=8, grace_period=1,
                  reduction_factor=2)
    plain = _race(ASHAScheduler(**kwargs))
    assert all(d == ("CONTINUE", "CONTINUE") for d in plain)  # first at each rung: goes on
    ours = _race(tuning.scheduler(_cfg(tune=True, epochs=8)))
    assert ours[0] == ("CONTINUE", "CONTINUE")  # alone at rung 1 when it got there
    assert ours[1] == ("STOP", "CONTINUE")  # then below the cutoff of rung 1: stopped


@pytest.mark.parametrize("key,value,needle", [
    ("lr_range", "0.1:0.01", "LO < HI"),
    ("lr_range", "1e-4:abc", "LO:HI"),
    ("lr_range", "0.1,-1", "numbers > 0"),
    ("batch_sizes", "32,0", "whole numbers >= 1"),
    ("scheduler", "hyperband", "asha, pbt, none"),
    ("search", "grid", "random, optuna"),
    ("num_samples", 0, ">= 1"),
    ("reduction_factor", 1, ">= 2"),
    ("max_concurrent_trials", 0, ">= 1"),
])
def test_bad_tune_settings_name_the_flag(key, value, needle):
    with pytest.raises(ConfigError) as err:
        _cfg(tune=True, **{key: value})
    assert str(err.value).startswith("--" + key.replace("_", "-")) and needle in str(err.value)


def test_cross_section_checks():
    with pytest.raises(ConfigError, match="--batch-sizes.*--num-workers"):
        tuning.check(_cfg(tune=True, num_workers=2, batch_sizes="1,64"))
    with pytest.raises(ConfigError, match="--grace-period.*--epochs"):
        tuning.check(_cfg(tune=True, epochs=2, grace_period=3))
    with pytest.raises(ConfigError, match="--perturbation-interval"):
        tuning.check(_cfg(tune=True, epochs=2, scheduler="pbt", perturbation_interval=2))


def test_optuna_missing_is_one_line_naming_search(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "optuna" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        _cfg(tune=True, search="optuna")
    assert str(err.value).startswith("--search: got 'optuna'")
    assert "pip install 'raytrain[tune]'" in str(err.value) and "\n" not in str(err.value)
    _cfg(tune=False, search="optuna")  # trials run with tune off: no check there


def test_yaml_gives_the_space(tmp_path, capsys):
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({"dataset": "digits", "num_workers": 1,
                                    "tune": {"tune": True, "lr_range": [0.01, 0.1],
                                             "batch_sizes": [32, 64], "scheduler": "none"}}))
    assert fit.main(["--config", str(path), "--dry-run"]) == 0
    flat = yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1].split("\nworkers:")[0])
    assert flat["lr_range"] == "0.01,0.1" and flat["batch_sizes"] == "32,64"
    cfg = _cfg(tune=True, lr_range=[0.01, 0.1], batch_sizes=[32, 64])
    assert cfg.tune.lr_space() == ("values", [0.01, 0.1])
    space = tuning.search_space(cfg)
    assert space["lr"] == {"grid_search": [0.01, 0.1]}


def test_default_concurrency_is_what_the_cluster_can_place(ray_cluster):
    assert tuning.placeable_trials(_cfg(num_workers=1), use_gpu=False) == 2
    assert tuning.placeable_trials(_cfg(num_workers=2), use_gpu=False) == 1
    assert tuning.placeable_trials(_cfg(num_workers=2, cpus_per_worker=2), use_gpu=False) == 1


def test_optuna_searcher_is_built_when_installed():
    pytest.importorskip("optuna")
    cfg = _cfg(tune=True, search="optuna")
    config = tuning.tune_config(cfg, concurrent=2)
    assert type(config.search_alg).__name__ == "OptunaSearch"
    assert tuning.search_space(_cfg(tune=True, search="optuna", lr_range="0.1,0.2"))["lr"] \
        .categories == [0.1, 0.2]


def test_retarget_remakes_optimizer_and_schedule_for_the_new_lr_and_batch():
    """PBT's explore: the donor's state, continued with another lr and batch size, follows the
    schedule the new config would have had at that epoch, and runs to the end without error."""
    from raytrain import checkpoint
    from raytrain.data import load_dataset, steps_per_epoch
    from raytrain.worker.loop import make_optimizer, make_scheduler

    donor, new = _cfg(lr=0.05, batch_size=64, epochs=4), _cfg(lr=0.2, batch_size=32, epochs=4)
    n = len(load_dataset("digits").train_y)
    model = SeedCNN(10)
    opt = make_optimizer(model, donor)
    steps = steps_per_epoch(n, 1, 64)
    sched = make_scheduler(opt, donor, steps * 4)
    for _ in range(2 * steps):
        opt.step()
        sched.step()
    state = checkpoint.training_state(model, opt, sched, None, 2, 2 * steps, donor.to_flat())
    moved = tuning.retarget(state, new)

    model2 = SeedCNN(10)
    opt2 = make_optimizer(model2, new)
    new_steps = steps_per_epoch(n, 1, 32)
    sched2 = make_scheduler(opt2, new, new_steps * 4)
    done, step = checkpoint.restore(moved, model2, opt2, sched2, None)
    assert (done, step) == (2, 2 * new_steps)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 model2.state_dict().values()))
    ref_opt = make_optimizer(SeedCNN(10), new)
    ref = make_scheduler(ref_opt, new, new_steps * 4)
    for _ in range(2 * new_steps):
        ref_opt.step()
        ref.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert opt2.param_groups[0]["max_lr"] == 0.2
    for _ in range(2 * new_steps):  # the rest of the new schedule: no "stepped too far" error
        opt2.step()
        sched2.step()
    assert tuning.retarget(state, donor) is state  # same lr and batch: untouched
