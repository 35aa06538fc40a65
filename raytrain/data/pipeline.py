"""The Ray Data pipeline of a streamed dataset and its sizing, on the driver.

    datasets, class_names, counts = build_datasets("imagefolder", "s3://bucket/imagenet", 224,
                                                   augment=True, seed=0)
    check_data_cpus(cluster_cpus=..., num_workers=..., cpus_per_worker=..., data_cpus=1)
    reserve_data_cpus(1)                      # before TorchTrainer(): it deep-copies DataContext
    TorchTrainer(loop, datasets=datasets, dataset_config=data_config(), ...)

Image folders: ``ray.data.range(tasks)`` -> one ``map_batches`` (``ListingRows``) whose task
``t`` takes its ``decode_batch`` rows of the epoch's permutation of the listing and decodes them
(one fused operator; no all-to-all shuffle). Parquet: ``read_parquet`` (file order shuffled per
epoch) -> ``map_batches(DecodeFn)``. Either way Ray Data's per-operator reservation is off
(``fast_context``: with it Ray 2.60 used half the CPUs). The tasks are ``map_batches`` with a
function: tasks, not an actor pool (an actor pool sized to the CPUs holds every CPU and the
read stage never runs, see the ingest notes); what they do is ``raytrain.data.decode``.

Ray is imported inside the functions: ``ListingRows`` is unpickled in Ray Data's task
processes, which import this module (and no torch).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from raytrain import ray_compat
from raytrain.data.decode import DecodeFn, epoch_index
from raytrain.data.listing import parquet_columns, resolve_fs, take_listing
from raytrain.errors import ConfigError


# ---------------------------------------------------------------------------- datasets


_ROWS_CACHE: dict = {}  # per process: listing ObjectRef -> table, (ref, epoch) -> row order


class ListingRows:
    """The ``map_batches`` function that turns task indices into listing rows, in the epoch's
    order, and applies ``fn`` to them: task ``t`` takes rows ``order[t*k:(t+1)*k]`` of the
    listing (``k`` = ``rows_per_task``), where ``order`` is a permutation drawn from
    ``(seed, epoch)`` when ``shuffle`` and the listing's order otherwise. Each epoch reads every
    row exactly once. ``fn`` (``DecodeFn``, ``pack.PackFn``) runs in the same task: a separate
    ``map_batches`` would not fuse with the task-index read, and Ray Data would bundle the
    tiny index blocks into one task.

    This is the whole shuffle: it needs no all-to-all ``random_shuffle`` (a barrier that held
    every epoch's first decode back by ~0.7 s on 1,500 files) and moves no pixels. The listing
    travels once through the object store (``ref``); each process keeps it, and the epoch's
    order, in ``_ROWS_CACHE``.
    """

    def __init__(self, ref, n: int, rows_per_task: int, shuffle: bool, seed: int,
                 fn: Callable[[dict], dict]):
        self.ref, self.n, self.k, self.shuffle, self.seed = ref, n, rows_per_task, shuffle, seed
        self.fn = fn

    def _order(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        key = (self.ref.hex(), epoch)
        if key not in _ROWS_CACHE:
            for old in [k for k in _ROWS_CACHE if isinstance(k, tuple) and k[0] == key[0]]:
                del _ROWS_CACHE[old]  # one epoch's order per listing at a time
            _ROWS_CACHE[key] = np.random.default_rng(
                [self.seed & 0xFFFFFFFF, epoch, 0x5EED]).permutation(self.n)
        return _ROWS_CACHE[key]

    def __call__(self, batch: dict):
        import ray

        if self.ref.hex() not in _ROWS_CACHE:
            _ROWS_CACHE[self.ref.hex()] = ray.get(self.ref)
        table = _ROWS_CACHE[self.ref.hex()]
        order = self._order(epoch_index())
        for t in np.asarray(batch["id"], np.int64):
            lo, hi = int(t) * self.k, min(int(t + 1) * self.k, self.n)
            rows = table.slice(lo, hi - lo) if order is None else table.take(order[lo:hi])
            yield self.fn({c: rows.column(c).to_numpy(zero_copy_only=False)
                           for c in rows.column_names})


def listing_dataset(table, rows_per_task: int, shuffle: bool, seed: int,
                    fn: Callable[[dict], dict]):
    """A Ray Data dataset of ``fn`` applied to the listing's rows (a numpy batch of ``path``,
    ``label``, ``row``, ``size``), ``rows_per_task`` rows per call and task, in a new order
    every epoch when ``shuffle`` (see ``ListingRows``)."""
    import ray
    import ray.data

    n = table.num_rows
    tasks = max(1, -(-n // rows_per_task))
    return ray.data.range(tasks, override_num_blocks=tasks).map_batches(
        ListingRows(ray.put(table), n, rows_per_task, shuffle, seed, fn), batch_size=None,
        batch_format="numpy")


def fast_context(ds):
    """Ray Data's per-operator resource reservation off for ``ds``: with it (the default in
    Ray 2.60) a one-operator pipeline like ours runs tasks on only half the CPUs it may use
    (measured: 20 tasks of 0.3 s on 2 CPUs took 5.3 s, 3.2 s without; on 8 CPUs 3.4 s vs
    1.8 s). Reservation keeps multi-operator pipelines from starving each other; ours fuse to
    one operator (read + decode), and ``--data-cpus`` still caps the total."""
    ds.context.op_resource_reservation_enabled = False
    return ds


def build_datasets(dataset: str, data_dir: str, image_size: int, augment: bool = True,
                   seed: int = 0, decode_on_worker: bool = False, decode_batch: int = 64
                   ) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    """Driver side: ``({"train": ds, "val": ds}, class_names, {"train": n, "val": n})``.

    Lists once (imagefolder) or checks every Parquet footer (parquet); raises ConfigError before
    anything runs. ``train`` is reshuffled every epoch from ``(seed, epoch)``: for imagefolder a
    full permutation of the small listing rows (paths, not pixels; ``ListingRows``); for Parquet
    the file order plus the row order written by ``raytrain.pack`` (a global shuffle of encoded
    bytes would move the whole dataset through the object store every epoch). ``val`` keeps its
    order. Each imagefolder task reads and decodes ``decode_batch`` images.
    """
    import ray.data

    listing = take_listing(dataset, data_dir)
    if image_size < 8:
        raise ConfigError("image_size", image_size, "an integer >= 8")
    fs = resolve_fs(data_dir)[0]
    out = {}
    class_names, counts = listing.class_names, listing.counts
    for split in ("train", "val"):
        fn = DecodeFn(fs, image_size, split == "train" and augment, seed,
                      bytes_only=decode_on_worker)
        if dataset == "imagefolder":
            ds = listing_dataset(listing.tables[split], decode_batch, shuffle=split == "train",
                                 seed=seed, fn=fn)
        else:
            from ray.data import FileShuffleConfig

            paths = listing.files[split]
            shuffle = FileShuffleConfig(seed=seed, reseed_after_execution=True) \
                if split == "train" else None
            ds = ray.data.read_parquet(paths, filesystem=fs, shuffle=shuffle,
                                       columns=parquet_columns(fs, paths[0]))
            ds = ds.map_batches(fn, batch_size=decode_batch, batch_format="numpy")
        out[split] = fast_context(ds)
    return out, class_names, counts


# ---------------------------------------------------------------------------- Train config


def data_config(start_epoch: Callable[[], int] | None = None):
    """``TorchTrainer(dataset_config=data_config())``: train split equally, val split exactly.

    ``train``: ``streaming_split(world, equal=True)``: every rank gets the same number of rows,
    so with the same batch size and ``drop_last`` every rank runs the same number of steps (DDP
    hangs otherwise); up to world-1 rows per epoch are dropped, different ones each epoch.
    ``val``: ``streaming_split(world, equal=False)``: every row goes to exactly one rank (none
    dropped: Ray #63285), ranks get different counts, so evaluation must not run collectives per
    batch (use the unwrapped module; sum loss/correct/count and all-reduce once at the end).
    Every val image is decoded once in total, and the split balances itself (a slow rank pulls
    fewer blocks), unlike an unsplit val that every rank reads and filters (world x the decode).

    ``start_epoch``: called (in Ray Train's dataset manager, each time a worker group starts)
    for the epoch the workers resume after; the pipelines' epoch count starts there, so a
    resumed run shuffles and crops epoch N+1 as an uninterrupted one would
    (``ray_compat.set_data_execution_index``).
    """
    import copy

    from ray.data import DataContext
    from ray.train import DataConfig

    class StreamingDataConfig(DataConfig):
        def __init__(self, start_epoch):
            super().__init__()
            self.start_epoch = start_epoch

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output = [{} for _ in range(world_size)]
            start = self.start_epoch() if self.start_epoch is not None else 0
            for name, ds in datasets.items():
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                # The trainer's copy of the driver's options (what DataConfig's
                # default_ingest_options carries over, without its deprecation warning)
                ds.context.execution_options = copy.deepcopy(
                    DataContext.get_current().execution_options)
                ray_compat.set_data_execution_index(ds.context, start)
                splits = ds.streaming_split(world_size, equal=name != "val",
                                            locality_hints=worker_node_ids)
                for i, split in enumerate(splits):
                    output[i][name] = split
            return output

    return StreamingDataConfig(start_epoch)


def steps_per_epoch(n_train: int, world: int, per_worker_batch: int, drop_last: bool = True
                    ) -> int:
    """Steps every rank runs per epoch with ``data_config()`` (equal split drops n % world)."""
    rows = n_train // world
    return rows // per_worker_batch if drop_last else -(-rows // per_worker_batch)


# ---------------------------------------------------------------------------- CPUs for data


def check_data_cpus(cluster_cpus: float, num_workers: int, cpus_per_worker: float,
                    data_cpus: float = 1, concurrent_runs: int = 1) -> float:
    """Preflight: the CPUs left for Ray Data's tasks; ConfigError when fewer than ``data_cpus``.

    Ray Data schedules its read/decode tasks on CPUs the Train workers do not hold; with every
    CPU held by workers the pipeline never starts. Returns the CPUs left per run.
    """
    held = num_workers * cpus_per_worker
    left = (cluster_cpus - held * concurrent_runs) / max(concurrent_runs, 1)
    if data_cpus <= 0 or left + 1e-9 < data_cpus:
        runs = f" x {concurrent_runs} concurrent trials" if concurrent_runs > 1 else ""
        fits = max((cluster_cpus / max(concurrent_runs, 1) - data_cpus) / num_workers, 0)
        raise ConfigError("data_cpus", data_cpus, f"a positive number of CPUs left for Ray Data "
                          f"by {num_workers} workers x {cpus_per_worker:g} CPUs{runs} on a "
                          f"{cluster_cpus:g}-CPU cluster ({max(left, 0):g} left per run); use "
                          f"fewer workers or --cpus-per-worker {fits:.2g}")
    return left


def reserve_data_cpus(data_cpus: float | None, verbose: bool = False) -> None:
    """Cap Ray Data at ``data_cpus`` CPUs in the current DataContext (call before building the
    TorchTrainer, which deep-copies the context); ``None`` leaves Ray Data every CPU the
    workers do not hold (its default). Its progress bars and per-execution log lines (one per
    epoch and split, forwarded to the driver's console) only with ``verbose``."""
    from ray.data import DataContext, ExecutionResources

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = ctx.print_on_execution_start = verbose
    ctx.execution_options.verbose_progress = verbose
    ctx.execution_options.resource_limits = (
        ExecutionResources.for_limits() if data_cpus is None
        else ExecutionResources.for_limits(cpu=data_cpus))

