"""What the driver prints: the dashboard line, --dry-run's plan, epochs as they are recorded,
the final summary.

    with EpochPrinter(run_dir, epochs):   # while the driver is blocked in trainer.fit()
        trainer.fit()
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import yaml

from raytrain import files
from raytrain.config import TrainConfig
from raytrain.driver import nodes
from raytrain.files import EVENTS_FILE
from raytrain.report import accuracy_lines, epoch_line, read_metrics, summary_table

TOKEN_FILE = os.path.expanduser("~/.ray/auth_token")


def print_dashboard(url: str | None, kept: bool) -> None:
    if not url:
        if kept:
            print("Ray dashboard: did not start (see the cluster's logs/dashboard.log); the "
                  "cluster stays up after the run: stop it with `ray stop`", flush=True)
        return
    auth = f"; sign in with the token in {TOKEN_FILE}" if os.path.exists(TOKEN_FILE) else ""
    life = ("it stays up after the run: stop it with `ray stop`" if kept else
            "it closes with this run (--keep-cluster keeps it)")
    print(f"Ray dashboard: http://{url.removeprefix('http://')}{auth}; {life}", flush=True)


def dry_run_text(cfg: TrainConfig) -> str:
    c = cfg.cluster
    lines = ["resolved config:", yaml.safe_dump(cfg.to_flat(), sort_keys=False).rstrip(),
             f"workers: {c.num_workers} x {c.worker_cpus:g} CPU"
             + {True: " + 1 GPU", False: "", None: " (+ 1 GPU each if the cluster has GPUs)"}[
                 c.use_gpu],
             f"batch: {cfg.optim.batch_size} global = {cfg.per_worker_batch} per worker x "
             f"{c.max_workers} workers",
             f"run directory: {cfg.run_location}"]
    return "\n".join(lines)


def print_summary(summary) -> None:
    print()
    print(summary_table(summary.rows))
    if summary.final:
        print("\n".join(accuracy_lines(summary.rows)))
    if summary.first_step_s is not None:
        phases = " + ".join(f"{name} {sec:.1f}" for name, sec in summary.startup or [])
        print(f"time to first step {summary.first_step_s:.1f}s"
              + (f" = {phases}" if phases else "") + f"; wall time {summary.wall_s:.1f}s")
    data = data_line(summary.rows)
    if data:
        print(data)
    print(f"run directory: {summary.run_dir}")
    if summary.model_path:
        f = summary.final
        which = ""
        if "test_acc_ema" in f:  # --ema: the checkpoint exported the better of the two
            ema = f["test_acc_ema"] > f["test_acc"]
            which = (f" (the EMA weights: test_acc_ema {f['test_acc_ema']:.4f} > test_acc "
                     f"{f['test_acc']:.4f})" if ema else f" (the raw weights: test_acc "
                     f"{f['test_acc']:.4f} >= test_acc_ema {f['test_acc_ema']:.4f})")
        print(f"weights: {summary.model_path}{which}")


def data_line(rows: list[dict]) -> str | None:
    """Streamed data: how long the first batch took, in the first epoch and (the slowest) in
    later ones, and how much of the training time the workers waited for data (the epochs of
    this run's rows)."""
    timed = [r for r in rows if r.get("first_batch_s") is not None]
    # first_step_at: an attempt's first epoch (the group started, or restarted, there)
    first = [r["first_batch_s"] for r in timed if r.get("first_step_at") is not None]
    later = [r["first_batch_s"] for r in timed if r.get("first_step_at") is None]
    waits = [r["data_wait"] for r in rows if "data_wait" in r]
    if not first or not waits:
        return None
    bad = sum(r.get("bad_images", 0) for r in rows)
    return (f"data: first batch {first[-1]:.1f}s into the first epoch"
            + (f", at most {max(later):.2f}s into a later one" if later else "")
            + f"; workers waited for data {100 * sum(waits) / len(waits):.0f}% of training time"
            + (f"; {bad} undecodable image(s) skipped (events.jsonl)" if bad else ""))


class Poller:
    """Runs ``self.poll()`` every ``interval_s`` on a daemon thread while used as a context
    (the driver is blocked in ``fit()`` meanwhile); polls once more on exit."""

    interval_s = 0.5

    def _start(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__,
                                        daemon=True)
        self._thread.start()

    def __enter__(self):
        self._start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        raise NotImplementedError


class EpochPrinter(Poller):
    """Prints epochs and worker failures as the run records them (the driver is blocked in
    fit(); the Train controller, on the driver's node, writes the files)."""

    def __init__(self, run_dir: str, epochs: int, out=None):
        # sys.stdout now, not at import: a redirected stdout (contextlib, pytest) sees the lines
        self.run_dir, self.epochs, self.out = run_dir, epochs, out or sys.stdout
        self.seen = {_row_key(r) for r in read_metrics(run_dir)}
        self.events = len(files.read_jsonl(os.path.join(run_dir, EVENTS_FILE)))
        self.printed: list[tuple[float, int]] = []  # (time printed, epoch) for the ETA
        self.failed = False  # a worker failed since the last epoch printed: the next restarts

    def poll(self) -> None:
        try:
            events = files.read_jsonl(os.path.join(self.run_dir, EVENTS_FILE))
            rows = read_metrics(self.run_dir)
        except (OSError, ValueError):  # mid-write; the next poll reads it
            return
        for event in events[self.events:]:
            if event["event"] == "log":
                print(event["text"], file=self.out, flush=True)
            elif event["event"] == "bad_image":
                print(f"{'skipped' if event['skipped'] else 'cannot decode'} image "
                      f"{event['image']} (epoch {event['epoch']})", file=self.out, flush=True)
            elif event["event"] == "worker_failure":
                print(f"worker failure: {event['error']}", file=self.out, flush=True)
                self.failed = True
            elif nodes.event_line(event) is not None:  # nodes lost/joined, waits, restarts
                print(nodes.event_line(event), file=self.out, flush=True)
        self.events = len(events)
        for m in rows:
            if _row_key(m) in self.seen:
                continue
            self.seen.add(_row_key(m))
            # The first epoch of every worker group says where it started; only one after a
            # failure is a recovery (a re-run's first says so before the run: driver/run.py).
            if self.failed and "resumed_from" in m:
                self.failed = False
                print(f"recovered: resumed from the epoch {m['resumed_from']} checkpoint"
                      if m["resumed_from"] else "recovered: restarted from epoch 1 (no "
                      "checkpoint yet)", file=self.out, flush=True)
            self.printed.append((time.monotonic(), m["epoch"]))
            (t0, e0), (t1, e1) = self.printed[0], self.printed[-1]
            eta = (t1 - t0) / (e1 - e0) * (self.epochs - e1) if e1 > e0 else None
            print(epoch_line(m, self.epochs, eta), file=self.out, flush=True)


def _row_key(row: dict[str, Any]) -> tuple:
    """An epoch as trained once: a rerun of it (after a failure) has its own timing."""
    return row["epoch"], row.get("epoch_s")
