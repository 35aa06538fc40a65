"""MLflow tracking (--mlflow-uri) against a real `mlflow server` on 127.0.0.1 (sqlite store,
served artifacts), read back with MlflowClient: the run, its params, per-epoch metrics and
artifacts; a resumed run continuing the same MLflow run; a Tune parent with child runs; the
server killed mid-run (training completes, one warning, the run directory whole)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import urllib.request

import psutil
import pytest
import yaml

from raytrain import fit
from tests.helpers import BIN, end_processes, free_port, metrics, wait_until

pytest.importorskip("mlflow")


class Server:
    """`mlflow server` in a process session of its own; ``kill`` ends it and its children."""

    def __init__(self, root):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runners
        env.pop("MLFLOW_TRACKING_URI", None)
        self.log = open(os.path.join(root, "server.log"), "w")
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "mlflow"), "server", "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
             "--artifacts-destination", os.path.join(root, "artifacts")],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self.healthy, 300, "mlflow server up", interval=0.5)

    def healthy(self) -> bool:
        assert self.proc.poll() is None, open(self.log.name).read()[-2000:]
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        end_processes(procs, grace_s=0)  # SIGTERM then SIGKILL: the server is just gone
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow"))
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(server.uri)


def _fit(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fit.main(argv)
    print(out.getvalue(), err.getvalue())
    return rc, out.getvalue(), err.getvalue()


def _runs(client, name: str, experiment: str = "raytrain") -> list:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:  # no run made it yet
        return []
    return client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'")


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


SMALL = ["--dataset", "digits", "--model", "lenet", "--num-workers", "2", "--batch-size", "64"]


def test_run_is_logged_and_a_resume_continues_it(ray_cluster, server, client, tmp_path):
    argv = SMALL + ["--storage-path", str(tmp_path), "--name", "digits-a",
                    "--mlflow-uri", server.uri]
    rc, out, err = _fit(argv + ["--epochs", "2"])
    assert rc == 0, err
    run_dir = tmp_path / "digits-a"
    (run,) = _runs(client, "digits-a")
    run_id = run.info.run_id
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    assert run_id in out and "warning" not in err
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert (p["model"], p["dataset"], p["epochs"], p["lr"]) == ("lenet", "digits", "2", "0.05")
    assert p["mlflow_experiment"] == "raytrain" and p["num_workers"] == "2"
    rows = metrics(run_dir)
    for key in ("train_loss", "test_acc", "lr", "images_per_s", "epoch_s"):
        history = client.get_metric_history(run_id, key)
        assert sorted((m.step, m.value) for m in history) == [(r["epoch"], r[key]) for r in rows]
    assert "first_step_at" not in run.data.metrics and "epoch" not in run.data.metrics
    assert {a.path for a in client.list_artifacts(run_id)} == {
        "model.pt", "learning_curves.png", "config.yaml"}
    model = client.download_artifacts(run_id, "model.pt", str(tmp_path))
    assert open(model, "rb").read() == (run_dir / "model.pt").read_bytes()

    # More epochs, --resume: the same MLflow run goes on from epoch 3.
    rc, out, err = _fit(argv + ["--epochs", "3", "--resume"])
    assert rc == 0, err
    assert [r.info.run_id for r in _runs(client, "digits-a")] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _steps(client, run_id, "test_acc") == [1, 2, 3]  # epochs 1-2 not logged twice
    assert run.data.params["epochs"] == "2"  # MLflow params never change: the new value is a tag
    assert run.data.tags["raytrain.config.epochs"] == "3"


def test_tune_search_is_a_parent_run_with_a_child_per_trial(ray_cluster, server, client,
                                                            tmp_path):
    rc, out, err = _fit(["--dataset", "digits", "--model", "lenet", "--tune", "--num-samples",
                         "2", "--epochs", "1", "--scheduler", "none", "--num-workers", "1",
                         "--batch-sizes", "64", "--storage-path", str(tmp_path), "--name",
                         "search-a", "--mlflow-uri", server.uri,
                         "--mlflow-experiment", "searches"])
    assert rc == 0, err
    (parent,) = _runs(client, "search-a", "searches")
    parent_id = parent.info.run_id
    assert parent.info.status == "FINISHED" and parent.data.params["tune"] == "True"
    assert parent.data.metrics["best_test_acc"] > 0.1
    assert {a.path for a in client.list_artifacts(parent_id)} >= {"results.csv", "config.yaml",
                                                                  "model.pt"}
    exp = client.get_experiment_by_name("searches")
    children = client.search_runs([exp.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent_id}'")
    trials = sorted(os.listdir(tmp_path / "search-a" / "trials"))
    assert sorted(c.info.run_name for c in children) == trials and len(trials) == 2
    for child in children:
        trial_dir = tmp_path / "search-a" / "trials" / child.info.run_name
        assert child.info.status == "FINISHED"
        assert child.data.tags["raytrain.status"] == "completed"
        with open(trial_dir / "config.yaml") as f:
            assert child.data.params["lr"] == str(yaml.safe_load(f)["lr"])
        assert child.data.params["tune"] == "False"
        assert _steps(client, child.info.run_id, "test_acc") == [1]
        assert child.data.metrics["test_acc"] == metrics(trial_dir)[-1]["test_acc"]


def test_mlflow_missing_is_one_line_before_ray(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what find_spec sees when not installed
    assert fit.main(["--dataset", "digits", "--mlflow-uri", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--mlflow-uri" in err and 'pip install ".[mlflow]"' in err


def test_env_uri_is_honoured_and_tracking_settings_may_change_on_a_rerun(monkeypatch,
                                                                         tmp_path):
    from raytrain.driver.run import prepare_run_dir, saved_epochs

    def cfg(*argv):
        return fit.resolve(fit.build_parser().parse_args(
            ["--dataset", "digits", "--storage-path", str(tmp_path), "--name", "r", *argv]))

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert cfg().tracking.uri == "http://127.0.0.1:5000"
    assert cfg("--mlflow-uri", "sqlite:///x.db").tracking.uri == "sqlite:///x.db"
    assert cfg("--mlflow-uri", "").tracking.uri is None  # '' = off, the variable set or not
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert cfg().tracking.uri is None
    prepare_run_dir(cfg())
    # Not training settings: the same run, without --resume
    assert saved_epochs(cfg("--mlflow-uri", "http://h:1", "--mlflow-experiment", "e")) == 0


def test_no_tracking_uri_never_imports_mlflow(tmp_path):
    code = ("import sys; from raytrain import fit; from raytrain.driver import run, tracking; "
            "from raytrain.tune import search; "
            "cfg = fit.resolve(fit.build_parser().parse_args(['--dataset', 'digits'])); "
            "tracking.RunTracker(cfg).__enter__().finish('FINISHED'); "
            "assert cfg.tracking.uri is None; assert 'mlflow' not in sys.modules; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


# Last in this file: it kills the module's server.
def test_server_killed_mid_run_is_one_warning(ray_cluster, server, client, tmp_path):
    run_dir = tmp_path / "digits-k"
    logged = threading.Event()

    def kill_after_first_epoch() -> None:  # once MLflow holds epoch 1
        def first_logged():
            runs = _runs(client, "digits-k")
            return runs and "test_acc" in client.get_run(runs[0].info.run_id).data.metrics
        wait_until(first_logged, 240, "epoch 1 in MLflow", interval=0.2)
        server.kill()
        logged.set()

    killer = threading.Thread(target=kill_after_first_epoch, daemon=True)
    killer.start()
    rc, out, err = _fit(SMALL + ["--epochs", "4", "--storage-path", str(tmp_path),
                                 "--name", "digits-k", "--mlflow-uri", server.uri])
    killer.join(5)
    assert logged.is_set(), "the server was not killed during the run"
    assert rc == 0, err
    warnings = [ln for ln in (out + err).splitlines() if "MLflow" in ln and "warning" in ln]
    assert len(warnings) == 1, warnings
    assert "training goes on" in warnings[0]
    assert [r["epoch"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    for name in ("model.pt", "learning_curves.png", "config.yaml", "mlflow_run_id"):
        assert (run_dir / name).exists(), name
