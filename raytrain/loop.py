"""The worker loop without Ray: one process, or one per rank under ``torchrun``.

    python -m raytrain.loop --dataset digits --epochs 3
    torchrun --standalone --nproc_per_node 2 -m raytrain.loop --model seed-cnn \
        --dataset synthetic --batch-size 128 --epochs 3

A face, like ``raytrain.fit``: it takes the CLI's flags and runs ``raytrain.worker.loop``'s
``run_worker`` (the very step Ray Train's workers run), so a GPU can be timed without Ray.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from raytrain.cli import build_parser, resolve
from raytrain.worker.loop import Worker, run_worker


def main(argv: list[str] | None = None, destroy: bool = True) -> int:
    """Takes raytrain.fit's flags (cluster and run-storage flags are ignored); prints one JSON
    line of metrics per epoch on rank 0. No checkpoints: it times and checks the real step.
    ``destroy``: tear the process group down at the end (``main_cli`` exits instead)."""
    cfg = resolve(build_parser().parse_args(argv))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if cfg.cluster.use_gpu is not False
                          and torch.cuda.is_available() else "cpu")
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    worker = Worker(int(os.environ.get("RANK", "0")), local_rank, world, device)

    def report(metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        if worker.master:
            print(json.dumps(metrics), flush=True)

    try:
        run_worker(cfg, worker, report)
        if dist.is_initialized():  # a rank leaving while another still talks: gloo aborted
            dist.barrier()         # one (SIGABRT, "terminate called", 1 of 3 digits runs)
    finally:
        if destroy and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main_cli() -> None:
    """``python -m raytrain.loop`` (and under torchrun): ``main``, then exit without the C++
    teardown. Two ranks tearing gloo down at once still aborted one after the barrier above
    ("terminate called without an active exception", SIGABRT; seen once in CI, 2026-12-06);
    past the barrier nothing is left to do, so each rank simply ends."""
    code = main(destroy=False)  # an error raises as before: its traceback, exit code 1 or 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main_cli()
