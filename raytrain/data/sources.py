"""The worker side of a streamed dataset: this rank's Ray Data shards as the worker loop's
source of batches (``Streamed``), and the val split read without Ray (``LocalVal``).

Inside ``train_loop_per_worker`` (every rank calls ``get_dataset_shard``)::

    train_it = ray.train.get_dataset_shard("train"); val_it = ray.train.get_dataset_shard("val")
    for x_uint8, y, bad in iter_batches(train_it, per_worker_batch, device, train=True): ...
    for x_uint8, y, bad in iter_batches(val_it, per_worker_batch, device, train=False):
        ...  # sum, then all-reduce once
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterator

import numpy as np

from raytrain.data.decode import DecodeFn, bad_rows, decode_batch
from raytrain.data.listing import PARQUET_COLUMNS, resolve_fs, take_listing
from raytrain.data.pipeline import steps_per_epoch


def _collate_fn():
    """Ray Data's numpy collate hook: torch tensors for the pixels and labels, the ``bad``
    names left on the host (read there without a device sync), bytes left as they are."""
    from ray.data.collate_fn import NumpyBatchCollateFn
    import torch

    class Collate(NumpyBatchCollateFn):
        def __call__(self, batch: dict) -> dict:
            if "bytes" in batch:
                return batch
            with warnings.catch_warnings():  # Ray's arrays are read-only; the batch is ours
                warnings.simplefilter("ignore", UserWarning)  # and nobody writes to it
                return {"image": torch.from_numpy(np.ascontiguousarray(batch["image"])),
                        "label": torch.from_numpy(np.asarray(batch["label"], np.int64)),
                        "bad": batch["bad"]}

    return Collate()


def iter_batches(shard, per_worker_batch: int, device, *, train: bool,
                 prefetch_batches: int = 4, decode: dict | None = None
                 ) -> Iterator[tuple[Any, Any, list[tuple[int, str]]]]:
    """Yield ``(x_uint8 [B,3,N,N], y int64 [B], [(row, name)] of bad images)`` on ``device``
    from a Train dataset shard.

    ``train=True`` drops the last partial batch: with ``data_config()``'s equal split every rank
    then yields exactly ``steps_per_epoch(...)`` batches. ``train=False`` keeps every row (val
    counts differ by rank; sum and all-reduce). ``decode``: for datasets built with
    ``decode_on_worker=True``, ``{"size": N, "train": bool, "seed": s}``; decoding then runs here
    with ``decode_batch`` on ``device``. Rows of images that could not be decoded are zeros;
    their rows and names come third.
    """
    import torch

    device = torch.device(device)
    for batch in shard.iter_torch_batches(batch_size=per_worker_batch,
                                          prefetch_batches=prefetch_batches, drop_last=train,
                                          collate_fn=_collate_fn()):
        if decode is None:
            yield (batch["image"].to(device, non_blocking=True),
                   batch["label"].to(device, non_blocking=True), bad_rows(batch["bad"]))
            continue
        epoch = int(batch["epoch"][0]) if len(batch["epoch"]) else 0
        x, bad = decode_batch(list(batch["bytes"]), decode["size"], decode["train"],
                              decode["seed"], epoch, batch["key"], device, batch["name"])
        y = torch.as_tensor(np.asarray(batch["label"], np.int64)).to(device, non_blocking=True)
        yield x, y, bad


IMAGENET_MEAN = (0.485, 0.456, 0.406)  # torchvision's ImageNet recipe
IMAGENET_STD = (0.229, 0.224, 0.225)


class Streamed:
    """Streamed images as the worker loop's source of batches (``worker/loop.py``): this
    rank's Ray Data shards of train and val. The loop needs no Ray: it sees ``steps``,
    ``train_batches`` and ``test_batches``, as for the in-memory ``builtin.InMemory``."""

    crop_pad = 0  # random-resized crops were taken where the images were decoded
    flip_ok = True

    def __init__(self, train_shard, val_shard, num_classes: int, n_train: int, n_val: int,
                 image_size: int, device, decode_on_worker: bool = False, seed: int = 0,
                 augment: bool = True):
        self.train_shard, self.val_shard = train_shard, val_shard
        self.num_classes, self.n_train, self.n_val = num_classes, n_train, n_val
        self.device = device
        self.decode = ({"size": image_size, "seed": seed, "train": augment}
                       if decode_on_worker else None)

    def normalization(self, how: str = "dataset") -> tuple[tuple[float, ...], ...]:
        if how == "none":
            return (0.0,) * 3, (1.0,) * 3
        if how == "half":
            return (0.5,) * 3, (0.5,) * 3
        return IMAGENET_MEAN, IMAGENET_STD

    def steps(self, world: int, per_worker_batch: int) -> int:
        return max(1, steps_per_epoch(self.n_train, world, per_worker_batch))

    def shard_size(self, rank: int, world: int) -> int:
        return self.n_train // world

    def train_batches(self, epoch: int, rank: int, world: int, seed: int, steps: int,
                      per_worker_batch: int):
        """This epoch's batches (Ray Data reshuffles and re-crops every pass)."""
        return iter_batches(self.train_shard, per_worker_batch, self.device, train=True,
                            decode=self.decode)

    def test_batches(self, rank: int, world: int, per_worker_batch: int):
        decode = dict(self.decode, train=False) if self.decode else None
        return iter_batches(self.val_shard, per_worker_batch, self.device, train=False,
                            decode=decode)


class LocalVal:
    """The val split of a streamed dataset read in this process, without Ray (``python -m
    raytrain.evaluate``): the same listing, eval crops and normalisation as training, decoded
    by a thread pool (PIL releases the GIL while decoding)."""

    crop_pad, flip_ok = 0, True
    normalization = Streamed.normalization

    def __init__(self, dataset: str, data_dir: str, image_size: int, batch: int = 256):
        self.listing = take_listing(dataset, data_dir)
        self.fs = resolve_fs(data_dir)[0]
        self.num_classes = len(self.listing.class_names)
        self.n_val = self.listing.counts["val"]
        self.size, self.batch = image_size, batch

    def _rows(self) -> Iterator[dict]:
        """Batches of rows as DecodeFn takes them (path or image bytes, label, ...)."""
        if self.listing.files is None:
            table = self.listing.tables["val"]
            for i in range(0, table.num_rows, self.batch):
                yield table.slice(i, self.batch).to_pydict()
            return
        import pyarrow.parquet as pq

        for path in self.listing.files["val"]:
            f = pq.ParquetFile(path, filesystem=self.fs)
            cols = [c for c in PARQUET_COLUMNS if c in f.schema_arrow.names]
            for rb in f.iter_batches(batch_size=self.batch, columns=cols):
                yield rb.to_pydict()

    def test_batches(self, rank: int = 0, world: int = 1, per_worker_batch: int = 0):
        import torch
        from concurrent.futures import ThreadPoolExecutor

        fn = DecodeFn(self.fs, self.size, train=False, seed=0)
        with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            for out in pool.map(fn, self._rows()):
                yield (torch.from_numpy(out["image"]), torch.from_numpy(out["label"]),
                       bad_rows(out["bad"]))
