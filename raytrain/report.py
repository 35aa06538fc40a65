"""Run files and console output: metrics.jsonl/csv, per-epoch lines, summary table, plots.

``python -m raytrain.report RUN_DIR`` re-draws the plot and prints the summary of a run.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from typing import Any

from raytrain.config import RaytrainError

METRICS = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "images_per_s",
           "epoch_s")


def _atomic_write(path: str, text: str) -> None:
    """Replace ``path`` whole or not at all: on a full disk the old file stays as it was."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def append_event(run_dir: str, event: dict[str, Any]) -> None:
    """Append one line, or nothing: a write cut short (full disk) is truncated away."""
    data = (json.dumps(event) + "\n").encode()
    fd = os.open(os.path.join(run_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def record_epoch(run_dir: str, metrics: dict[str, Any]) -> None:
    """Add one epoch to metrics.jsonl/.csv, replacing that epoch and any later one.

    A worker group restarted from the checkpoint of epoch k re-runs k+1..: the file keeps
    every epoch exactly once.
    """
    rows = [r for r in read_metrics(run_dir) if r["epoch"] < metrics["epoch"]] + [metrics]
    _atomic_write(os.path.join(run_dir, "metrics.jsonl"),
                  "".join(json.dumps(r) + "\n" for r in rows))
    lines = [",".join(METRICS)] + [",".join(str(r.get(k, "")) for k in METRICS) for r in rows]
    _atomic_write(os.path.join(run_dir, "metrics.csv"), "\n".join(lines) + "\n")


def startup_phases(started_at: float, driver: list[tuple[str, float]], row: dict[str, Any]
                   ) -> list[tuple[str, float]]:
    """Where the time to first step went: (phase, seconds), each ending at its mark. The
    driver's marks, then rank 0's (``loop.run_worker``) from an epoch row of this attempt."""
    worker = row.get("startup") or {}
    marks = driver + [("worker start", worker.get("process")),
                      ("worker setup", worker.get("loop")), ("data", worker.get("data")),
                      ("model", worker.get("model")), ("first step", row["first_step_at"])]
    phases, last = [], started_at
    for name, at in marks:
        if at:
            phases.append((name, at - last))
            last = at
    return phases


def epoch_line(m: dict[str, Any], epochs: int, eta_s: float | None = None) -> str:
    eta = "" if eta_s is None else f"  ETA {int(eta_s) // 60}:{int(eta_s) % 60:02d}"
    return (f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  "
            f"train_acc {m['train_acc']:.4f}  test_loss {m['test_loss']:.4f}  "
            f"test_acc {m['test_acc']:.4f}  lr {m['lr']:.2e}  "
            f"{m['images_per_s']:,.0f} img/s  {m['epoch_s']:.1f}s{eta}")


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

    def __init__(self, run_dir: str, epochs: int, out=sys.stdout):
        self.run_dir, self.epochs, self.out = run_dir, epochs, out
        self.seen = {_row_key(r) for r in read_metrics(run_dir)}
        self.events = len(read_jsonl(os.path.join(run_dir, "events.jsonl")))
        self.printed: list[tuple[float, int]] = []  # (time printed, epoch) for the ETA

    def poll(self) -> None:
        try:
            events = read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
            rows = read_metrics(self.run_dir)
        except (OSError, ValueError):  # mid-write; the next poll reads it
            return
        for event in events[self.events:]:
            if event["event"] == "log":
                print(event["text"], file=self.out, flush=True)
            else:
                print(f"worker failure: {event['error']}", file=self.out, flush=True)
        self.events = len(events)
        for m in rows:
            if _row_key(m) in self.seen:
                continue
            self.seen.add(_row_key(m))
            if m.get("resumed_from"):
                print(f"recovered: resumed from the epoch {m['resumed_from']} checkpoint",
                      file=self.out, flush=True)
            self.printed.append((time.monotonic(), m["epoch"]))
            (t0, e0), (t1, e1) = self.printed[0], self.printed[-1]
            eta = (t1 - t0) / (e1 - e0) * (self.epochs - e1) if e1 > e0 else None
            print(epoch_line(m, self.epochs, eta), file=self.out, flush=True)


def _row_key(row: dict[str, Any]) -> tuple:
    """An epoch as trained once: a rerun of it (after a failure) has its own timing."""
    return row["epoch"], row.get("epoch_s")


def summary_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'epoch':>5} {'train_loss':>10} {'train_acc':>9} {'test_loss':>9} " \
           f"{'test_acc':>8} {'img/s':>9} {'epoch_s':>7}"
    lines = [head] + [
        f"{r['epoch']:>5} {r['train_loss']:>10.4f} {r['train_acc']:>9.4f} "
        f"{r['test_loss']:>9.4f} {r['test_acc']:>8.4f} {r['images_per_s']:>9,.0f} "
        f"{r['epoch_s']:>7.2f}" for r in rows]
    return "\n".join(lines)


def final_line(rows: list[dict[str, Any]]) -> str:
    """The summary's verdict: the last epoch's test accuracy and the best one."""
    final, best = rows[-1], max(rows, key=lambda r: r["test_acc"])
    return (f"final test_acc {final['test_acc']:.4f} (best {best['test_acc']:.4f} at epoch "
            f"{best['epoch']}), test_loss {final['test_loss']:.4f}")


def plot_curves(run_dir: str, rows: list[dict[str, Any]]) -> str | None:
    """learning_curves.png: loss and accuracy vs epoch, train and test."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split in ("train", "test"):
        ax_loss.plot(epochs, [r[f"{split}_loss"] for r in rows], marker="o", label=split)
        ax_acc.plot(epochs, [r[f"{split}_acc"] for r in rows], marker="o", label=split)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    path = os.path.join(run_dir, "learning_curves.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m raytrain.report",
                                     description="Summarise a finished run and re-draw plots.")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    rows = read_metrics(args.run_dir)
    if not rows:
        print(f"raytrain: error: {args.run_dir}: no metrics.jsonl", file=sys.stderr)
        return 2
    print(summary_table(rows))
    print(final_line(rows))
    print(f"plot: {plot_curves(args.run_dir, rows)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RaytrainError as err:
        print(f"raytrain: error: {err}", file=sys.stderr)
        sys.exit(2)
