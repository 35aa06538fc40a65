"""ASHA vs no early stopping on the same search: compute spent and best accuracy found.

    python benchmarks/tune_asha_vs_none.py --quick         # smoke test (2 x 2 epochs each)
    python benchmarks/tune_asha_vs_none.py                 # digits, 8 trials, 20 epochs, 1 worker
    python benchmarks/tune_asha_vs_none.py --seeds 0,1,2   # three samples of 8 configs
    python benchmarks/tune_asha_vs_none.py --epochs 10 --num-samples 4
    python benchmarks/tune_asha_vs_none.py --seeds 0,1,2,3 --out-dir D --reuse   # re-read D

Runs the same command twice, as a user would, each on its own new local Ray cluster:

    python -m raytrain.fit --tune --num-samples 8 --num-workers 1 --dataset digits --epochs 20
        --scheduler {asha,none} --seed 0 --storage-path TMP --name {asha,none}

The seed fixes the sampled (lr, batch size) of every trial, so both searches try the same 8
configs and differ only in what the scheduler stops (ASHA at raytrain's defaults unless
--grace-period/--reduction-factor are given). --seeds runs one such pair per seed. From each results.csv: worker-epochs spent
(sum of epochs run over trials x --num-workers), the best test_acc of any trial (its best
epoch), and wall time. Targets (issue #4): ASHA spends <= 40% of the worker-epochs of none;
its best test_acc is within 0.5 points of none's; the best tuned run reaches >= 0.985.
The last stdout line is one JSON object with both runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time


def run_search(scheduler: str, seed: int, args, storage: str) -> dict:
    name = f"{scheduler}-seed{seed}"
    cmd = [sys.executable, "-m", "raytrain.fit", "--tune", "--num-samples", str(args.num_samples),
           "--num-workers", str(args.num_workers), "--dataset", args.dataset,
           "--epochs", str(args.epochs), "--scheduler", scheduler, "--seed", str(seed),
           "--storage-path", storage, "--name", name]
    for flag in ("grace_period", "reduction_factor"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    print("$ " + " ".join(cmd[1:]), flush=True)
    results = os.path.join(storage, name, "results.csv")
    if args.reuse and os.path.exists(results):  # this search already ran into --out-dir
        print(f"  (reusing {results})", flush=True)
        return summarize_search(scheduler, seed, args, results, wall=float("nan"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new local cluster
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - started
    with open(os.path.join(storage, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return summarize_search(scheduler, seed, args, results, wall)


def summarize_search(scheduler: str, seed: int, args, results: str, wall: float) -> dict:
    with open(results, newline="") as f:
        rows = list(csv.DictReader(f))
    done = [r for r in rows if r["best_test_acc"]]
    best = max(done, key=lambda r: float(r["best_test_acc"]))
    return {
        "scheduler": scheduler, "seed": seed, "trials": len(rows),
        "worker_epochs": sum(int(r["epochs_run"]) for r in rows) * args.num_workers,
        "best_test_acc": float(best["best_test_acc"]), "best_lr": float(best["lr"]),
        "best_batch_size": int(best["batch_size"]), "best_epoch": int(best["best_epoch"]),
        "statuses": {s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}},
        "wall_s": round(wall, 1),
    }


def compare(asha: dict, none: dict) -> dict:
    print(f"\nseed {asha['seed']}:")
    print(f"{'':<22} {'asha':>12} {'none':>12} {'asha/none':>10}")
    for key, fmt in (("worker_epochs", "{:>12d}"), ("best_test_acc", "{:>12.4f}"),
                     ("wall_s", "{:>12.1f}")):
        ratio = asha[key] / none[key] if none[key] else float("nan")
        print(f"{key:<22} " + fmt.format(asha[key]) + " " + fmt.format(none[key])
              + f" {ratio:>10.2f}")
    for run in (asha, none):
        print(f"{run['scheduler']}: best lr {run['best_lr']:.4g} batch {run['best_batch_size']} "
              f"(epoch {run['best_epoch']}); trials {run['statuses']}")
    return {"seed": asha["seed"], "asha": asha, "none": none,
            "worker_epoch_ratio": round(asha["worker_epochs"] / none["worker_epochs"], 3),
            "best_gap_points": round((none["best_test_acc"] - asha["best_test_acc"]) * 100, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--grace-period", type=int, help="ASHA (default: raytrain's)")
    p.add_argument("--reduction-factor", type=int, help="ASHA (default: raytrain's)")
    p.add_argument("--seeds", default="0", help="comma-separated; one asha/none pair each")
    p.add_argument("--out-dir", help="keep the searches here (default: a temp dir)")
    p.add_argument("--reuse", action="store_true", help="read a search already in --out-dir "
                   "(same name) instead of running it again")
    p.add_argument("--quick", action="store_true", help="a smoke test: 2 trials x 2 epochs "
                   "of digits each (its numbers mean nothing)")
    args = p.parse_args()
    if args.quick:
        args.num_samples, args.epochs, args.seeds = 2, 2, "0"
    storage = args.out_dir or tempfile.mkdtemp(prefix="raytrain-tune-bench-")
    os.makedirs(storage, exist_ok=True)
    pairs = []
    for seed in [int(x) for x in args.seeds.split(",")]:
        asha, none = run_search("asha", seed, args, storage), run_search("none", seed, args,
                                                                          storage)
        pairs.append(compare(asha, none))
    spent = sum(q["asha"]["worker_epochs"] for q in pairs)
    full = sum(q["none"]["worker_epochs"] for q in pairs)
    print()
    for q in pairs:
        print(f"seed {q['seed']}: ASHA spent {q['worker_epoch_ratio']:.0%} of the worker-epochs "
              f"(target <= 40%); best test_acc {q['best_gap_points']:+.2f} points below none's "
              f"(target <= 0.5); best of both "
              f"{max(q['asha']['best_test_acc'], q['none']['best_test_acc']):.4f} "
              "(target >= 0.985)")
    print(f"all seeds: ASHA {spent} / none {full} worker-epochs = {spent / full:.0%}")
    print(f"searches kept in {storage}")
    print(json.dumps({"pairs": pairs, "worker_epoch_ratio": round(spent / full, 3)}))


if __name__ == "__main__":
    main()
