"""MLflow tracking, from the driver: one MLflow run per raytrain run, a parent run with a child
per trial for a Tune search (``--mlflow-uri URI`` or ``$MLFLOW_TRACKING_URI``).

    mlflow server --host 127.0.0.1 --port 5000 &
    python -m raytrain.fit --dataset digits --name digits-a --mlflow-uri http://127.0.0.1:5000

Where it hooks in: a ``console.Poller`` beside ``console.EpochPrinter``, reading the run
directory's metrics.jsonl on the driver while ``fit()`` blocks. Not the Train controller's
``RunFiles`` callback: that runs in the controller actor, so mlflow would be imported into every
controller (and every Tune trial's), a failure's warning would reach the user through Ray's log
forwarding under an actor prefix, and a search's trials would each need the parent run's id
and their own connection. metrics.jsonl is already the record of every epoch (the controller
writes it, ``EpochPrinter`` prints from it), so the driver logs exactly what the run directory
holds; a background thread keeps a slow or dead server (and mlflow's import, seconds on a
loaded machine) off the training's path.

A resumed run continues its MLflow run: its id is in ``RUN_DIR/mlflow_run_id`` (a search's in
``STORAGE/NAME/mlflow_run_id``, each trial's in ``trials/TRIAL_ID/mlflow_run_id``); epochs past
the last one MLflow holds are logged, so epochs missed while the server was down go in then.
MLflow params cannot change: those a resume changes (e.g. ``--epochs``) become tags
``raytrain.config.KEY``. The first failed call (server down, refusing, not found) is one
warning line; tracking then stops for the rest of the command and training goes on.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable

import yaml

from raytrain import files, report
from raytrain.config import TrainConfig
from raytrain.driver.console import Poller
from raytrain.errors import Interrupted

RUN_ID_FILE = "mlflow_run_id"
ARTIFACTS = ("model.pt", "learning_curves.png", "config.yaml")  # a training run's, at the end
# Row keys that are not per-epoch measurements: the x axis, wall-clock stamps, where it resumed.
NOT_METRICS = {"epoch", "first_step_at", "resumed_from"}
# A dead server must cost seconds, not mlflow's default of 7 retries with exponential backoff
# (minutes) and 120 s timeouts; the user's own settings win. mlflow prints "View run ..." links
# at every run's end: raytrain prints its own line once.
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "1"}


class Tracking:
    """One MLflow client for this command; after its first failure, one warning and off."""

    def __init__(self, uri: str, experiment: str):
        self.uri, self.experiment = uri, experiment
        self.on = True
        self._client = None
        self._experiment_id: str | None = None

    def call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``, or None once tracking is off (this failure's warning printed)."""
        if not self.on:
            return None
        try:
            return fn(self.client)
        except Exception as err:  # noqa: BLE001 - whatever the server or client raises
            self.on = False
            print(f"raytrain: warning: MLflow tracking stopped ({what} at {self.uri}: "
                  f"{_reason(err)}); training goes on, the run directory keeps every epoch",
                  file=sys.stderr, flush=True)
            return None

    @property
    def client(self):
        if self._client is None:
            for key, value in CLIENT_ENV.items():
                os.environ.setdefault(key, value)
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.uri)
        return self._client

    def experiment_id(self, client) -> str:
        if self._experiment_id is None:
            found = client.get_experiment_by_name(self.experiment)
            self._experiment_id = (found.experiment_id if found is not None
                                   else client.create_experiment(self.experiment))
        return self._experiment_id

    def open_run(self, run_dir: str, name: str, params: dict[str, Any],
                 parent_id: str | None = None) -> str | None:
        """The MLflow run of ``run_dir``: the one its RUN_ID_FILE names (marked running
        again), else a new one, recorded there. None when tracking is off."""
        return self.call("starting the run", lambda c: self._open(c, run_dir, name, params,
                                                                  parent_id))

    def _open(self, client, run_dir: str, name: str, params: dict[str, Any],
              parent_id: str | None) -> str:
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        path = os.path.join(run_dir, RUN_ID_FILE)
        run = None
        if os.path.exists(path):
            with open(path) as f:
                run_id = f.read().strip()
            try:
                run = client.get_run(run_id)
            except MlflowException as err:
                if err.error_code != "RESOURCE_DOES_NOT_EXIST":  # another server: a new run
                    raise
            if run is not None and run.info.lifecycle_stage == "deleted":
                run = None
        params = {k: _param(v) for k, v in params.items()}
        if run is None:
            tags = {"raytrain.run_dir": run_dir} | (
                {"mlflow.parentRunId": parent_id} if parent_id else {})
            run = client.create_run(self.experiment_id(client), run_name=name, tags=tags)
            files.atomic_write(path, run.info.run_id + "\n")
            old: dict[str, str] = {}
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            old = run.data.params
        run_id = run.info.run_id
        new = [Param(k, v) for k, v in params.items() if k not in old]
        changed = [RunTag(f"raytrain.config.{k}", v) for k, v in params.items()
                   if k in old and old[k] != v]
        for i in range(0, max(len(new), len(changed)), 100):  # MLflow's batch limit: 100
            client.log_batch(run_id, params=new[i:i + 100], tags=changed[i:i + 100])
        return run_id

    def logged_through(self, run_id: str) -> int:
        """The last epoch MLflow holds for ``run_id`` (0: none)."""
        def last(client) -> int:
            run = client.get_run(run_id)
            if not run.data.metrics:
                return 0
            key = next(iter(run.data.metrics))
            return max((m.step for m in client.get_metric_history(run_id, key)), default=0)

        return self.call("reading the run", last) or 0

    def log_rows(self, run_id: str, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(r["epoch"])) for r in rows
                   for k, v in r.items() if k not in NOT_METRICS and _number(v)]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit: 1000 metrics
            self.call("logging metrics", lambda c: c.log_batch(run_id, metrics=metrics[i:i + 1000]))

    def log_artifacts(self, run_id: str, paths: list[str]) -> None:
        for path in paths:
            if os.path.exists(path):
                self.call(f"uploading {os.path.basename(path)}",
                          lambda c: c.log_artifact(run_id, path))

    def end(self, run_id: str, status: str) -> None:
        """Status: FINISHED, FAILED or KILLED."""
        self.call("ending the run", lambda c: c.set_terminated(run_id, status))


class RunLog:
    """What of one run directory's metrics.jsonl is in its MLflow run; logs the rest."""

    def __init__(self, tracking: Tracking, run_id: str, run_dir: str):
        self.tracking, self.run_id, self.run_dir = tracking, run_id, run_dir
        done = tracking.logged_through(run_id)
        self.seen = {_row_key(r) for r in report.read_metrics(run_dir) if r["epoch"] <= done}

    def sync(self) -> None:
        try:
            rows = report.read_metrics(self.run_dir)
        except (OSError, ValueError):  # mid-write; the next poll reads it
            return
        new = [r for r in rows if _row_key(r) not in self.seen]
        if new and self.tracking.on:
            self.tracking.log_rows(self.run_id, new)
            self.seen.update(_row_key(r) for r in new)


class _Tracker(Poller):
    """A context that feeds MLflow on a background thread (``poll``) while the driver waits,
    and ends the MLflow run(s) FAILED (KILLED on Ctrl-C) if the body raises before
    ``finish``. Does nothing without a tracking URI."""

    def __init__(self, cfg: TrainConfig):
        uri = cfg.tracking.uri
        self.tracking = Tracking(uri, cfg.tracking.mlflow_experiment) if uri else None
        self.cfg = cfg
        self._polling = self._ended = False

    def __enter__(self):
        if self.tracking is not None:
            self._start()
            self._polling = True
        return self

    def __exit__(self, kind, *exc) -> None:
        self._halt()
        if kind is not None and not self._ended:
            killed = issubclass(kind, (KeyboardInterrupt, Interrupted))
            self.finish("KILLED" if killed else "FAILED")

    def _halt(self) -> None:
        """Stop the thread, then log what the run directory holds now."""
        if self._polling:
            self._polling = False
            Poller.__exit__(self, None, None, None)

    def finish(self, status: str, **kw: Any) -> None:
        if self.tracking is None or self._ended:
            return
        self._halt()
        self._ended = True
        self._end(status, **kw)

    def _end(self, status: str, **kw: Any) -> None:
        raise NotImplementedError


class RunTracker(_Tracker):
    """One training run's MLflow run, opened and fed its epochs while the run trains.

        with RunTracker(cfg) as tracker:
            trainer.fit() ...; export model.pt, plot
            tracker.finish("FINISHED")            # uploads ARTIFACTS, ends the MLflow run
    """

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.log: RunLog | None = None

    def poll(self) -> None:
        t = self.tracking
        if self.log is None and t.on:
            run_id = t.open_run(self.cfg.run_dir, self.cfg.run.name, self.cfg.to_flat())
            if run_id is not None:
                self.log = RunLog(t, run_id, self.cfg.run_dir)
                print(f"MLflow: run {self.cfg.run.name} ({run_id}) in experiment "
                      f"{t.experiment} at {t.uri}", flush=True)
        if self.log is not None:
            self.log.sync()

    def _end(self, status: str, artifacts: tuple[str, ...] = ARTIFACTS) -> None:
        if self.log is None:
            return
        if status == "FINISHED":
            self.tracking.log_artifacts(self.log.run_id, [os.path.join(self.cfg.run_dir, a)
                                                          for a in artifacts])
        self.tracking.end(self.log.run_id, status)


class SearchTracker(_Tracker):
    """A Tune search: one parent MLflow run for STORAGE/NAME and a child run per trial (named
    after the trial id, params from ``trials/TRIAL_ID/config.yaml``), each fed its trial's
    metrics.jsonl from the driver while the search runs. A search on a bucket: the trials
    in the driver's mirror are those on the driver's node; a trial on another node is logged
    when the search ends, once the driver has brought its files over (``tune.trial.pull_trials``).

        with SearchTracker(cfg) as tracker:
            grid = tuner.fit() ...; results.csv, tune.png, model.pt
            tracker.finish("FINISHED", trial_statuses={...}, metrics={...})
    """

    interval_s = 1.0

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.parent_id: str | None = None
        self.children: dict[str, RunLog] = {}

    @property
    def trials_dir(self) -> str:
        return os.path.join(self.cfg.run_dir, "trials")

    def poll(self) -> None:
        t = self.tracking
        if self.parent_id is None and t.on:
            self.parent_id = t.open_run(self.cfg.run_dir, self.cfg.run.name, self.cfg.to_flat())
            if self.parent_id is not None:
                print(f"MLflow: search {self.cfg.run.name} ({self.parent_id}) in experiment "
                      f"{t.experiment} at {t.uri}, a child run per trial", flush=True)
        if self.parent_id is None:
            return
        trials = sorted(os.listdir(self.trials_dir)) if os.path.isdir(self.trials_dir) else []
        for trial_id in trials:
            trial_dir = os.path.join(self.trials_dir, trial_id)
            if trial_id not in self.children and t.on:
                params = _read_yaml(os.path.join(trial_dir, "config.yaml"))
                if params is None:  # not written yet: the next poll
                    continue
                run_id = t.open_run(trial_dir, trial_id, params, parent_id=self.parent_id)
                if run_id is None:
                    return
                self.children[trial_id] = RunLog(t, run_id, trial_dir)
            if trial_id in self.children:
                self.children[trial_id].sync()

    def _end(self, status: str, trial_statuses: dict[str, str] | None = None,
             metrics: dict[str, float] | None = None,
             artifacts: tuple[str, ...] = ("model.pt", "tune.png", "results.csv",
                                           "config.yaml")) -> None:
        """Every child ends as its trial did (``trial_statuses``: trial id -> completed /
        stopped / failed, also tagged raytrain.status; others KILLED), then the parent, with
        the search's files and ``metrics``."""
        t, statuses = self.tracking, trial_statuses or {}
        if self.parent_id is None:
            return
        for trial_id, log in self.children.items():
            state = statuses.get(trial_id, "")
            if state:
                t.call("tagging a trial", lambda c: c.set_tag(log.run_id, "raytrain.status",
                                                              state))
            t.end(log.run_id, {"completed": "FINISHED", "stopped": "FINISHED",
                               "failed": "FAILED"}.get(state, "KILLED"))
        if metrics:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            t.call("logging metrics", lambda c: c.log_batch(self.parent_id, metrics=[
                Metric(k, float(v), now, 0) for k, v in metrics.items() if _number(v)]))
        if status == "FINISHED":
            t.log_artifacts(self.parent_id, [os.path.join(self.cfg.run_dir, a)
                                             for a in artifacts])
        t.end(self.parent_id, status)


def _read_yaml(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _param(value: Any) -> str:
    return str(value)[:6000]  # MLflow's limit on a param value


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _row_key(row: dict[str, Any]) -> tuple:
    """An epoch as trained once (console's key: a re-run epoch has its own timing)."""
    return row["epoch"], row.get("epoch_s")


def _reason(err: BaseException) -> str:
    """The gist of an MLflow client error, in a few words."""
    text = str(err)
    for needle, gist in (("Connection refused", "connection refused"),
                         ("Read timed out", "timed out"), ("timed out", "timed out"),
                         ("Max retries exceeded", "unreachable")):
        if needle in text:
            return gist
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return first[:160]
