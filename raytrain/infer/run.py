"""One prediction run on the driver: checks (before Ray starts), cluster, sizing, the pipeline
streamed into the output file, progress lines and the summary.

    summary = predict(cfg)    # cfg: raytrain.predict.PredictConfig
"""

from __future__ import annotations

import os
import sys
import time
from typing import NamedTuple

from raytrain.errors import RaytrainError


class Summary(NamedTuple):
    images: int
    errors: int
    wall_s: float
    out: str

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s if self.wall_s > 0 else 0.0

    def text(self) -> str:
        return (f"predicted {self.images:,} images ({self.errors:,} could not be read) in "
                f"{self.wall_s:.1f} s: {self.images_per_s:,.0f} images/s -> {self.out}")


def check_inputs(cfg):
    """Every check that needs no cluster, before any Ray process starts: (spec, weights,
    inputs). One line each: MODEL, --model, --classes, --data-dir, --out."""
    from raytrain.infer import inputs, model, output

    output.check_writable(cfg.out)
    spec, weights = model.resolve(cfg.model_path, cfg.model, cfg.classes, cfg.image_size,
                                  cfg.stem, cfg.normalize)
    found = inputs.list_inputs(cfg.data_dir)
    return spec, weights, found


def local_plan(cfg):
    """The layout checked against the local cluster raytrain would start (no --address):
    refused before it starts, in seconds."""
    import ray

    from raytrain import ray_compat
    from raytrain.infer.pipeline import size_layout

    if cfg.address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        return None
    gpus = 0
    if cfg.use_gpu:
        import torch

        gpus = torch.cuda.device_count()
    return size_layout(ray_compat.local_cpus(), gpus, cfg.num_workers, cfg.use_gpu,
                       cfg.cpus_per_worker, cfg.data_cpus)


def predict(cfg) -> Summary:
    from raytrain.driver import cluster

    t0 = time.monotonic()
    spec, weights, found = check_inputs(cfg)
    local_plan(cfg)
    started = cluster.connect(cfg.address, cfg.verbose)
    try:
        return _run(cfg, spec, weights, found, t0)
    finally:
        cluster.disconnect(started)


def _run(cfg, spec, weights, found, t0: float) -> Summary:
    import ray

    from raytrain.data.pipeline import reserve_data_cpus
    from raytrain.infer.output import Output
    from raytrain.infer.pipeline import build_dataset, run_failed, size_layout

    total = ray.cluster_resources()
    plan = size_layout(total.get("CPU", 0.0), total.get("GPU", 0.0), cfg.num_workers,
                       cfg.use_gpu, cfg.cpus_per_worker, cfg.data_cpus)
    reserve_data_cpus(None, cfg.verbose)  # no cap: the actors are part of the pipeline
    if not cfg.verbose:  # Ray Data's "execution finished" INFO line, its progress-bar note,
        import logging  # and its traceback of a failure this module words in one line

        logging.getLogger("ray.data").setLevel(logging.ERROR)
        logging.getLogger("ray.data.exceptions").setLevel(logging.CRITICAL)
    print(f"predict: {found.n:,} {'images' if found.kind == 'images' else 'Parquet rows'} "
          f"under {found.data_dir}; {spec.model} ({spec.num_classes} classes, "
          f"{spec.image_size}px); {plan.num_workers} worker(s) x {plan.cpus_per_worker:g} CPU"
          + (" + 1 GPU" if plan.use_gpu else "") + f", {plan.data_cpus:g} CPUs left for "
          "decoding", flush=True)
    ds = build_dataset(spec, weights, found, plan, cfg.batch_size, cfg.top_k,
                       cfg.wait_timeout)
    progress = Progress(found.n, cfg.progress_every)
    errors, failure = 0, None
    try:
        with Output(cfg.out, cfg.top_k) as out:
            for table in ds.iter_batches(batch_size=None, batch_format="pyarrow",
                                         prefetch_batches=2):
                out.write(table)
                errors += table.num_rows - table.column("error").to_pylist().count("")
                progress.update(out.rows, errors)
    except RaytrainError:
        raise
    except KeyboardInterrupt:
        raise
    except Exception as err:  # a Ray task/actor failure: one line, exit 1
        failure = run_failed(err, plan, cfg.wait_timeout)
    if failure is not None:
        # The dataset's actors end with its last reference: an actor whose start timed out
        # (--wait-timeout) still starts once CPUs free up, and held one CPU of a cluster the
        # driver stays on (seen in CI) until Python's cycle collector ran.
        del ds
        import gc

        gc.collect()
        raise failure
    return Summary(out.rows, errors, time.monotonic() - t0, cfg.out)


class Progress:
    """A line every ``every`` seconds: done/total, images/s so far, ETA."""

    def __init__(self, total: int, every: float):
        self.total, self.every = total, every
        self.start = self.last = time.monotonic()

    def update(self, done: int, errors: int) -> None:
        now = time.monotonic()
        if not self.every or now - self.last < self.every:
            return
        self.last = now
        rate = done / (now - self.start)  # start-up included: what the whole run will average
        eta = f"{(self.total - done) / rate:.0f}s" if rate > 0 else "?"
        print(f"predict: {done:,}/{self.total:,} images  {rate:,.0f} images/s  ETA {eta}  "
              f"errors {errors:,}", flush=True, file=sys.stdout)
