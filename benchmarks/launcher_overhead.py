"""raytrain vs the seed's torchrun DDP script on the same job: throughput, wall time, time to
first step. Paired, alternating runs; medians; ratios raytrain/torchrun.

    python benchmarks/launcher_overhead.py            # 5 pairs, then 5 raytrain runs on a warm cluster
    python benchmarks/launcher_overhead.py --quick    # 1 pair, 1 warm run
    python benchmarks/launcher_overhead.py --mode cold --pairs 7
    python benchmarks/launcher_overhead.py --mode warm --address 10.0.0.5:6379   # your cluster

The job (both sides): the seed's Net (conv 3->32, conv 32->64, fc 4096->512->10; 7.7M
multiply-adds per image), 2 CPU workers, 64 images per worker per step (raytrain's
--batch-size is global: 128), SGD lr 0.001 momentum 0.9, no weight decay, constant lr, no
augmentation, ToTensor() inputs, 3 epochs of 6,400 CIFAR-shaped synthetic images (the same
pixels on both sides):

  (a) torchrun --standalone --nproc_per_node 2 benchmarks/seed_ddp.py --epochs 3 --train-size 6400
          --batch-size 64 --loader-workers 0
  (b) python -m raytrain.fit --num-workers 2 --model seed-cnn --dataset synthetic
          --synthetic-size 6400 --batch-size 128 --epochs 3 --lr 0.001 --lr-schedule constant
          --no-augment --normalize none --weight-decay 0 --storage-path TMP --name UNIQUE
          [+ --address ADDR in warm mode]

The seed's DataLoader had num_workers=4; on 2 cores that is the slower choice (3 epochs x 3,200
images, 2 ranks: 261 images/s per worker with 4 loader processes per rank, 667 with 0, measured
2026-12-03 on a loaded machine), so the baseline runs with 0: the comparison favours torchrun.

Cold mode (default part 1): each pair runs (a) and (b) back to back, alternating which goes
first (pair 0: torchrun first, pair 1: raytrain first, ...) so slow drift of the machine hits
both sides alike. (b) starts its own fresh local Ray cluster (no --address, RAY_ADDRESS unset),
as a user's first `python -m raytrain.fit` does. Warm mode (part 2): a head is started once
(`ray start --head --block --num-cpus 2` in its own temp dir and process group, free ports),
then (b) runs --warm-runs times against it with --address; the head is stopped at the end by
signalling only the process group this script started. --address ADDR uses your cluster
instead and starts/stops nothing.

Measured per run (all from this process's clock; same machine):
  * images/s per worker, steady state: epochs 2..N. torchrun: seed_ddp.py's JSON line (total
    images / total training-loop seconds per worker, mean over workers). raytrain: from
    <storage>/<name>/metrics.jsonl, sum(train_count) / sum(epoch_s) / workers over epochs 2..N
    (the per-epoch `images_per_s` is global and training-only, like the seed's figure).
  * wall: from just before the process is spawned to its exit.
  * time to first step from process spawn: until rank 0's first optimizer step ended
    (seed: `first_step_at` in its JSON; raytrain: `first_step_at` of epoch 1 in metrics.jsonl).
    raytrain also prints its own "time to first step X s" (counted from its import of
    raytrain.fit, so it omits interpreter start) and that time by phase; both are shown,
    the phases as medians.
  * raytrain only: wall split into startup (to first step), training (first step -> last
    metrics.jsonl write) and teardown (last write -> exit: export, plots, cluster shutdown).
Medians over runs; ratios are raytrain/torchrun: throughput higher is better, wall and time to
first step lower is better. Targets (issue #7): throughput >= 1.0x, wall <= 1.5x, time to first
step <= 10 s against a running cluster. Each run's full output is kept in --out-dir.
The last stdout line is one JSON object with every run and the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKERS = 2
PER_WORKER_BATCH = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=5, help="cold (torchrun, raytrain) pairs")
    p.add_argument("--warm-runs", type=int, default=None,
                   help="raytrain runs against the warm cluster (default: --pairs)")
    p.add_argument("--mode", choices=("cold", "warm", "both", "short", "tune", "all"),
                   default="all", help="both: cold + warm; all: both + short + tune")
    p.add_argument("--short-pairs", type=int, default=3,
                   help="short-job pairs: the README's main job vs the same under torchrun")
    p.add_argument("--tune-samples", type=int, default=4)
    p.add_argument("--tune-epochs", type=int, default=6)
    p.add_argument("--address", default=None,
                   help="warm mode: an existing cluster (HOST:PORT); default: start a head here")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-size", type=int, default=6400)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out-dir", default=None, help="logs and run directories (default: tmp)")
    p.add_argument("--keep", action="store_true", help="keep --out-dir (default: remove "
                   "run directories, keep nothing unless a run failed)")
    p.add_argument("--raytrain-args", default="",
                   help="extra flags for raytrain.fit, e.g. '--weight-decay 0'")
    p.add_argument("--quick", action="store_true", help="1 pair and 1 warm run")
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.short_pairs, args.tune_samples, args.tune_epochs = 1, 1, 2, 2
    if args.warm_runs is None:
        args.warm_runs = 1 if args.quick else args.pairs
    return args


def child_env(warm: bool = False) -> dict[str, str]:
    """The environment both sides run in: no RAY_ADDRESS (a fresh local cluster), each
    launcher's own thread default (both give 1 thread per 1-CPU worker).

    Warm mode sets RAY_AUTH_MODE=token when ~/.ray/auth_token exists (as cluster configs must,
    DESIGN.md): `ray start --head` then turns token auth on, and Ray 2.60's client sends the
    token to an *explicit* address only when RAY_AUTH_MODE=token (ray/_private/worker.py
    auto-enables it for address None/"auto" only); without it `--address` fails after ~20 s of
    "InvalidAuthToken" retries.
    """
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if warm and "RAY_AUTH_MODE" not in env and os.path.exists(
            os.path.expanduser("~/.ray/auth_token")):
        env["RAY_AUTH_MODE"] = "token"
    return env


def _spawn(cmd: list[str], log_path: str, timeout: float, warm: bool = False
           ) -> tuple[int, float, float, str]:
    """Run ``cmd``; returns (exit code, start epoch time, wall seconds, combined output)."""
    t_epoch = time.time()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=child_env(warm), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # only the group this call started
            proc.wait()
            rc = -9
    wall = time.perf_counter() - t0
    with open(log_path) as f:
        return rc, t_epoch, wall, f.read()


def torchrun_cmd(args) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launcher = [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]
    return launcher + ["--standalone", f"--nproc_per_node={WORKERS}",
                       os.path.join(HERE, "seed_ddp.py"), "--epochs", str(args.epochs),
                       "--train-size", str(args.train_size),
                       "--batch-size", str(PER_WORKER_BATCH), "--loader-workers", "0"]


def raytrain_cmd(args, storage: str, name: str, address: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "raytrain.fit", "--num-workers", str(WORKERS),
           "--model", "seed-cnn", "--dataset", "synthetic",
           "--synthetic-size", str(args.train_size),
           "--batch-size", str(PER_WORKER_BATCH * WORKERS), "--epochs", str(args.epochs),
           "--lr", "0.001", "--lr-schedule", "constant", "--no-augment",
           "--normalize", "none", "--weight-decay", "0",
           "--storage-path", storage, "--name", name]
    if address:
        cmd += ["--address", address]
    return cmd + args.raytrain_args.split()


def run_torchrun(args, out_dir: str, tag: str) -> dict:
    log = os.path.join(out_dir, f"{tag}.log")
    rc, t_start, wall, output = _spawn(torchrun_cmd(args), log, args.timeout)
    res = {"side": "torchrun", "tag": tag, "rc": rc, "wall_s": wall, "log": log}
    lines = [ln for ln in output.splitlines() if ln.startswith("{") and '"seed_ddp"' in ln]
    if rc != 0 or not lines:
        res["error"] = f"exit {rc}; see {log}"
        return res
    seed = json.loads(lines[-1])
    res["images_per_s_per_worker"] = seed["images_per_s_per_worker"]
    res["epoch_images_per_s_per_worker"] = [
        round(sum(col) / len(col), 1) for col in zip(*seed["epoch_images_per_s_by_rank"])]
    res["first_step_s"] = seed["first_step_at"] - t_start
    res["threads_per_worker"] = seed["threads_per_worker"]
    return res


FIRST_STEP_RE = re.compile(r"time to first step\s*([0-9.]+)\s*s")
PHASES_RE = re.compile(r"time to first step [0-9.]+s = (.*?); wall time")


def run_raytrain(args, out_dir: str, tag: str, address: str | None) -> dict:
    storage = os.path.join(out_dir, "runs")
    name = f"{tag}-{uuid.uuid4().hex[:8]}"
    log = os.path.join(out_dir, f"{tag}.log")
    rc, t_start, wall, output = _spawn(raytrain_cmd(args, storage, name, address), log,
                                       args.timeout, warm=address is not None)
    t_exit = t_start + wall
    res = {"side": "raytrain", "tag": tag, "rc": rc, "wall_s": wall, "log": log,
           "cluster": "warm" if address else "cold"}
    metrics_path = os.path.join(storage, name, "metrics.jsonl")
    rows = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(ln) for ln in f if ln.strip()]
    if rc != 0 or not rows:
        res["error"] = f"exit {rc}; see {log}"
        return res
    steady = [r for r in rows if r["epoch"] >= 2] or rows
    n = sum(r.get("train_count", r["images_per_s"] * r["epoch_s"]) for r in steady)
    res["images_per_s_per_worker"] = n / sum(r["epoch_s"] for r in steady) / WORKERS
    res["epoch_images_per_s_per_worker"] = [round(r["images_per_s"] / WORKERS, 1) for r in rows]
    first = rows[0].get("first_step_at")
    if first:
        res["first_step_s"] = first - t_start
        last_write = os.path.getmtime(metrics_path)
        res["split_s"] = {"startup": first - t_start, "training": last_write - first,
                          "teardown": t_exit - last_write}
    printed = FIRST_STEP_RE.findall(output)
    res["printed_first_step_s"] = float(printed[-1]) if printed else None
    phases = PHASES_RE.findall(output)  # "Ray up 6.1 + preflight 0.2 + ... + first step 0.1"
    if phases:
        res["phases_s"] = {name: float(sec) for name, sec in
                           (p.rsplit(" ", 1) for p in phases[-1].split(" + "))}
    if not args.keep:
        shutil.rmtree(os.path.join(storage, name), ignore_errors=True)
    return res


# ---------------------------------------------------------------------------- warm cluster


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Head:
    """A one-node Ray head in its own temp dir and process group; stopped by signalling only
    that group (never `ray stop`, which would stop every cluster on the machine)."""

    def __init__(self, out_dir: str):
        self.temp_dir = tempfile.mkdtemp(prefix="rtb-", dir="/tmp")  # short: unix sockets
        self.log = os.path.join(out_dir, "ray-head.log")
        self.proc = None
        self.address = None

    def start(self, timeout: float = 120) -> str:
        ports = free_ports(8)
        exe = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [exe if os.path.exists(exe) else "ray", "start", "--head", "--block",
               "--num-cpus", str(WORKERS), "--temp-dir", self.temp_dir,
               "--port", str(ports[0]), "--ray-client-server-port", str(ports[1]),
               "--dashboard-port", str(ports[2]), "--dashboard-agent-listen-port", str(ports[3]),
               "--dashboard-agent-grpc-port", str(ports[4]),
               "--runtime-env-agent-port", str(ports[5]),
               "--metrics-export-port", str(ports[6]), "--disable-usage-stats"]
        env = child_env(warm=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        recorded = os.path.join(self.temp_dir, "ray_current_cluster")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited {self.proc.returncode}; see "
                                   f"{self.log}")
            if os.path.exists(recorded):
                with open(recorded) as f:
                    self.address = f.read().strip() or None
                if self.address:
                    time.sleep(2)  # let the raylet register before the first job
                    return self.address
            time.sleep(0.5)
        raise RuntimeError(f"ray start --head not up after {timeout:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        time.sleep(1)
        for pid in self._leftovers():  # processes of this head that left the group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _leftovers(self) -> list[int]:
        """Processes whose command line names this head's unique temp dir (so: its own)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if self.temp_dir.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
        return found


# ---------------------------------------------------------------------------- short jobs


def loop_cmd(workers: int, *flags: str) -> list[str]:
    """The hand-written equivalent: torchrun over raytrain's own per-worker loop (the same
    model, data, schedule and step; no Ray, no checkpoints), one JSON line per epoch."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launcher = [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]
    return launcher + ["--standalone", f"--nproc_per_node={workers}", "-m", "raytrain.loop",
                       *flags]


def epoch_fixed_cost(rows: list[dict]) -> float | None:
    """Median seconds an epoch costs besides training (evaluation, checkpoint, report): the
    gap between consecutive epochs' starts less the earlier one's epoch_s."""
    gaps = [b["started_at"] - a["started_at"] - a["epoch_s"] for a, b in zip(rows, rows[1:])
            if "started_at" in a and "started_at" in b]
    return statistics.median(gaps) if gaps else None


def run_short_pair(args, out_dir: str, i: int) -> tuple[dict, dict]:
    """The README's main job (`python -m raytrain.fit --num-workers 2 --dataset digits`, its
    defaults) and the same training under torchrun, alternating which goes first."""
    storage = os.path.join(out_dir, "runs")
    name = f"short-{i}-{uuid.uuid4().hex[:8]}"
    out = {}
    for side in (("torchrun", "raytrain") if i % 2 == 0 else ("raytrain", "torchrun")):
        log = os.path.join(out_dir, f"short-{side}-{i}.log")
        cmd = loop_cmd(WORKERS, "--dataset", "digits") if side == "torchrun" else [
            sys.executable, "-m", "raytrain.fit", "--num-workers", str(WORKERS), "--dataset",
            "digits", "--storage-path", storage, "--name", name]
        rc, t_start, wall, output = _spawn(cmd, log, args.timeout)
        res = {"side": side, "tag": f"short-{side}-{i}", "rc": rc, "wall_s": wall, "log": log}
        if side == "torchrun":
            rows = [json.loads(ln) for ln in output.splitlines() if ln.startswith('{"epoch"')]
        else:
            rows = [json.loads(ln) for ln in open(os.path.join(storage, name, "metrics.jsonl"))
                    ] if rc == 0 else []
        if rc != 0 or not rows:
            res["error"] = f"exit {rc}; see {log}"
        else:
            res.update(test_acc=rows[-1]["test_acc"], epochs=len(rows),
                       epoch_s=sum(r["epoch_s"] for r in rows),
                       first_step_s=rows[0]["first_step_at"] - t_start,
                       fixed_per_epoch_s=epoch_fixed_cost(rows),
                       epoch_s_median=statistics.median(r["epoch_s"] for r in rows))
        out[side] = res
        print(f"{res['tag']:<20} " + ("FAILED: " + res["error"] if "error" in res else
              f"wall {wall:5.1f}s  first step {res['first_step_s']:.1f}s  {res['epochs']} "
              f"epochs {res['epoch_s']:.1f}s  fixed/epoch {fmt(res['fixed_per_epoch_s'], '.3f')}"
              f"s  test_acc {res['test_acc']:.4f}"), flush=True)
    shutil.rmtree(os.path.join(storage, name), ignore_errors=True)
    return out["torchrun"], out["raytrain"]


def run_tune(args, out_dir: str) -> dict:
    """A search (`--tune --num-samples S --num-workers 1 --dataset digits --epochs E`, ASHA),
    then its trials' configs trained one after another under torchrun (1 process each): the
    search's wall against the sum of its trials' epoch_s and against torchrun's."""
    storage = os.path.join(out_dir, "runs")
    name = f"tune-{uuid.uuid4().hex[:8]}"
    log = os.path.join(out_dir, "tune.log")
    rc, _, wall, _ = _spawn([sys.executable, "-m", "raytrain.fit", "--tune", "--num-samples",
                             str(args.tune_samples), "--num-workers", "1", "--dataset",
                             "digits", "--epochs", str(args.tune_epochs), "--storage-path",
                             storage, "--name", name], log, args.timeout)
    res = {"side": "raytrain", "tag": "tune", "rc": rc, "wall_s": wall, "log": log}
    trials = os.path.join(storage, name, "trials")
    if rc != 0 or not os.path.isdir(trials):
        res["error"] = f"exit {rc}; see {log}"
        return res
    epoch_s, worker_epochs, seq_wall = 0.0, 0, 0.0
    for trial in sorted(os.listdir(trials)):
        rows = [json.loads(ln) for ln in open(os.path.join(trials, trial, "metrics.jsonl"))]
        epoch_s += sum(r["epoch_s"] for r in rows)
        worker_epochs += len(rows)
        with open(os.path.join(trials, trial, "config.yaml")) as f:
            conf = dict(ln.split(": ", 1) for ln in f.read().splitlines() if ": " in ln)
        t_log = os.path.join(out_dir, f"tune-torchrun-{trial}.log")
        t_rc, _, t_wall, _ = _spawn(loop_cmd(1, "--dataset", "digits", "--epochs",
                                             str(len(rows)), "--lr", conf["lr"],
                                             "--batch-size", conf["batch_size"]), t_log,
                                    args.timeout)
        if t_rc != 0:
            res["error"] = f"torchrun for {trial}: exit {t_rc}; see {t_log}"
            return res
        seq_wall += t_wall
    res.update(trials=len(os.listdir(trials)), worker_epochs=worker_epochs,
               trial_epoch_s=epoch_s, torchrun_sequential_s=seq_wall)
    print(f"tune: {res['trials']} trials, {worker_epochs} worker-epochs, epoch_s {epoch_s:.1f}"
          f"s, search wall {wall:.1f}s ({wall / max(epoch_s, 1e-9):.1f}x); the same trainings "
          f"under torchrun one after another {seq_wall:.1f}s", flush=True)
    shutil.rmtree(os.path.join(storage, name), ignore_errors=True)
    return res


def short_rows(pairs: list[tuple[dict, dict]], tune: dict | None) -> tuple[list[str], dict]:
    rows, out = [], {}
    ok = [(t, r) for t, r in pairs if "error" not in t and "error" not in r]
    if ok:
        m = {side: {k: statistics.median(p[i][k] for p in ok if p[i][k] is not None)
                    for k in ("wall_s", "first_step_s", "epoch_s", "epoch_s_median")}
             for i, side in enumerate(("torchrun", "raytrain"))}
        fixed = [r["fixed_per_epoch_s"] for _, r in ok if r["fixed_per_epoch_s"] is not None]
        t, r = m["torchrun"], m["raytrain"]
        rows += ["", f"short job: the README's main job, {len(ok)} pair(s) (medians)",
                 f"{'':<34}{'torchrun':>12}{'raytrain':>12}{'ratio r/t':>11}{'target':>14}",
                 f"{'wall, process start-exit s':<34}{t['wall_s']:>12.1f}{r['wall_s']:>12.1f}"
                 f"{r['wall_s'] / t['wall_s']:>10.2f}x{'<= 30 s':>14}",
                 f"{'time to first step s':<34}{t['first_step_s']:>12.1f}"
                 f"{r['first_step_s']:>12.1f}{r['first_step_s'] / t['first_step_s']:>10.2f}x"
                 f"{'<= 10 s':>14}",
                 f"{'sum of epoch_s s':<34}{t['epoch_s']:>12.1f}{r['epoch_s']:>12.1f}"
                 f"{r['epoch_s'] / t['epoch_s']:>10.2f}x",
                 f"{'test_acc (each pair)':<34}" + "  ".join(
                     f"{a['test_acc']:.4f}/{b['test_acc']:.4f}" for a, b in ok)]
        if fixed:
            f = statistics.median(fixed)
            rows.append(f"{'raytrain per-epoch fixed cost s':<34}{'':>12}{f:>12.3f}"
                        f"{f / r['epoch_s_median']:>10.1%} of an epoch (< 10%)")
        out["short_job"] = {"torchrun": t, "raytrain": r, "fixed_per_epoch_s":
                            statistics.median(fixed) if fixed else None, "pairs": len(ok)}
    if tune and "error" not in tune:
        ratio_epochs = tune["wall_s"] / max(tune["trial_epoch_s"], 1e-9)
        rows += ["", f"tune: {tune['trials']} trials x {tune['worker_epochs']} worker-epochs",
                 f"{'search wall s':<34}{tune['torchrun_sequential_s']:>12.1f}"
                 f"{tune['wall_s']:>12.1f}"
                 f"{tune['wall_s'] / tune['torchrun_sequential_s']:>10.2f}x",
                 f"{'search wall / sum of epoch_s':<34}{'':>12}{ratio_epochs:>11.1f}x"
                 f"{'<= 3x':>14}"]
        out["tune"] = {**{k: tune[k] for k in ("wall_s", "trial_epoch_s", "worker_epochs",
                                                "torchrun_sequential_s", "trials")},
                       "ratio_epoch_s": ratio_epochs}
    return rows, out


# ---------------------------------------------------------------------------- report


def med(results: list[dict], key: str) -> float | None:
    vals = [r[key] for r in results if r.get(key) is not None and "error" not in r]
    return statistics.median(vals) if vals else None


def fmt(v, spec: str) -> str:
    return format(v, spec) if v is not None else "n/a"


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def describe(r: dict) -> str:
    if "error" in r:
        return f"{r['tag']:<14} FAILED: {r['error']}"
    text = (f"{r['tag']:<14} {r['images_per_s_per_worker']:>8,.0f} img/s/worker "
            f"(epochs {r['epoch_images_per_s_per_worker']})  wall {r['wall_s']:6.1f}s  "
            f"first step {fmt(r.get('first_step_s'), '.1f')}s")
    if r["side"] == "raytrain":
        text += f" (printed {fmt(r.get('printed_first_step_s'), '.1f')}s)"
        if "split_s" in r:
            s = r["split_s"]
            text += (f"  split: startup {s['startup']:.1f} + training {s['training']:.1f} + "
                     f"teardown {s['teardown']:.1f}s")
    return text


def summary(torch_runs, cold_runs, warm_runs) -> tuple[list[str], dict]:
    t_ips, t_wall, t_first = (med(torch_runs, k) for k in
                              ("images_per_s_per_worker", "wall_s", "first_step_s"))
    rows, out = [], {"torchrun": {"images_per_s_per_worker": t_ips, "wall_s": t_wall,
                                  "first_step_s": t_first, "runs": len(torch_runs)}}
    head = (f"{'median over runs':<34}{'torchrun':>12}{'raytrain':>12}{'ratio r/t':>11}"
            f"{'target':>14}")
    for label, runs in (("cold cluster", cold_runs), ("warm cluster", warm_runs)):
        if not runs:
            continue
        r_ips, r_wall, r_first, r_printed = (med(runs, k) for k in (
            "images_per_s_per_worker", "wall_s", "first_step_s", "printed_first_step_s"))
        ok = [r for r in runs if "error" not in r]
        rows += ["", f"raytrain on a {label} ({len(ok)}/{len(runs)} runs ok; torchrun "
                 f"{len([r for r in torch_runs if 'error' not in r])} runs)", head,
                 f"{'images/s per worker (epochs 2..N)':<34}{fmt(t_ips, ',.0f'):>12}"
                 f"{fmt(r_ips, ',.0f'):>12}{fmt(ratio(r_ips, t_ips), '.2f'):>10}x"
                 f"{'>= 1.0x':>14}",
                 f"{'wall time, process start-exit s':<34}{fmt(t_wall, '.1f'):>12}"
                 f"{fmt(r_wall, '.1f'):>12}{fmt(ratio(r_wall, t_wall), '.2f'):>10}x"
                 f"{'<= 1.5x':>14}",
                 f"{'time to first step s':<34}{fmt(t_first, '.1f'):>12}"
                 f"{fmt(r_first, '.1f'):>12}{fmt(ratio(r_first, t_first), '.2f'):>10}x"
                 f"{'<= 10 s warm' if label == 'warm cluster' else '':>14}",
                 f"{'  (raytrain printed)':<34}{'':>12}{fmt(r_printed, '.1f'):>12}"]
        splits = [r["split_s"] for r in ok if "split_s" in r]
        if splits:
            parts = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
            rows.append(f"{'  raytrain wall split (medians) s':<34}" + ", ".join(
                f"{k} {v:.1f}" for k, v in parts.items()))
        phases = [r["phases_s"] for r in ok if "phases_s" in r]
        if phases:
            rows.append(f"{'  raytrain first step by phase s':<34}" + ", ".join(
                f"{k} {statistics.median(p.get(k, 0.0) for p in phases):.1f}"
                for k in phases[0]))
        out[label.replace(" ", "_")] = {
            "images_per_s_per_worker": r_ips, "wall_s": r_wall, "first_step_s": r_first,
            "printed_first_step_s": r_printed, "runs": len(runs), "ok": len(ok),
            "ratio_images_per_s": ratio(r_ips, t_ips), "ratio_wall": ratio(r_wall, t_wall),
            "ratio_first_step": ratio(r_first, t_first)}
    return rows, out


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="raytrain-launcher-bench-")
    os.makedirs(out_dir, exist_ok=True)
    print(f"launcher_overhead: {args.pairs} cold pair(s), {args.warm_runs} warm run(s), "
          f"mode {args.mode}; {args.epochs} epochs x {args.train_size} images, {WORKERS} "
          f"workers x {PER_WORKER_BATCH}/step; logs in {out_dir}", flush=True)
    torch_runs, cold_runs, warm_runs = [], [], []
    if args.mode in ("cold", "both", "all") or (args.mode == "warm" and args.pairs):
        for i in range(args.pairs):
            order = ("torchrun", "raytrain") if i % 2 == 0 else ("raytrain", "torchrun")
            for side in order:
                if side == "torchrun":
                    r = run_torchrun(args, out_dir, f"torchrun-{i}")
                    torch_runs.append(r)
                elif args.mode != "warm":
                    r = run_raytrain(args, out_dir, f"raytrain-{i}", None)
                    cold_runs.append(r)
                else:
                    continue
                print(describe(r), flush=True)
    if args.mode in ("warm", "both", "all") and args.warm_runs:
        head = None
        try:
            address = args.address
            if address is None:
                head = Head(out_dir)
                t0 = time.perf_counter()
                address = head.start()
                print(f"warm cluster: started a head at {address} in "
                      f"{time.perf_counter() - t0:.1f}s (temp dir {head.temp_dir})", flush=True)
            for i in range(args.warm_runs):
                r = run_raytrain(args, out_dir, f"raytrain-warm-{i}", address)
                warm_runs.append(r)
                print(describe(r), flush=True)
        finally:
            if head is not None:
                head.stop()
    pairs = [run_short_pair(args, out_dir, i) for i in range(args.short_pairs)
             ] if args.mode in ("short", "all") else []
    tune = run_tune(args, out_dir) if args.mode in ("tune", "all") else None
    rows, result = summary(torch_runs, cold_runs, warm_runs)
    more_rows, more = short_rows(pairs, tune)
    print("\n".join(rows + more_rows))
    result.update(more)
    failed = [r for r in torch_runs + cold_runs + warm_runs + [x for p in pairs for x in p]
              + ([tune] if tune else []) if "error" in r]
    if not failed and not args.keep and args.out_dir is None:
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir = None
    result.update(benchmark="launcher_overhead", epochs=args.epochs, train_size=args.train_size,
                  workers=WORKERS, per_worker_batch=PER_WORKER_BATCH, logs=out_dir,
                  runs=torch_runs + cold_runs + warm_runs, short_runs=pairs, tune_run=tune)
    print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
