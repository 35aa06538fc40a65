"""Streaming datasets (image folders, Parquet shards) through Ray Data, decoded to uint8 crops.

Driver::

    datasets, class_names, counts = build_datasets("imagefolder", "s3://bucket/imagenet", 224,
                                                   augment=True, seed=0)
    check_data_cpus(cluster_cpus=..., num_workers=..., cpus_per_worker=..., data_cpus=1)
    reserve_data_cpus(1)                      # before TorchTrainer(): it deep-copies DataContext
    TorchTrainer(loop, datasets=datasets, dataset_config=data_config(), ...)

Worker (inside ``train_loop_per_worker``; every rank calls ``get_dataset_shard``)::

    train_it = ray.train.get_dataset_shard("train"); val_it = ray.train.get_dataset_shard("val")
    for x_uint8, y in iter_batches(train_it, per_worker_batch, device, train=True): ...
    for x_uint8, y in iter_batches(val_it, per_worker_batch, device, train=False): ...  # sum, all-reduce

Layouts
-------
``imagefolder``: ``DIR/train/<class>/*`` and ``DIR/val/<class>/*`` (``DIR/test/`` if there is no
``val/``), as torchvision's ``ImageFolder``: label = index of the class folder in sorted order;
files whose extension (any case) is in ``IMG_EXTENSIONS`` count, anything else is ignored. DIR
is a local/NFS path or an ``s3://`` / ``gs://`` URI (pyarrow filesystems, as Ray Data uses; an
S3-compatible endpoint is taken from ``AWS_ENDPOINT_URL``). The driver lists the files once into
a small Arrow table (``path``, ``label``, ``row``) instead of ``read_images`` over the paths
(Ray #40686/#55760: minutes of listing and GBs of path metadata for millions of files).

``parquet``: ``DIR/train/*.parquet``, ``DIR/val/*.parquet`` (``test/`` accepted) and
``DIR/classes.json``. Columns (the names Hugging Face image exports and Ray's ingest benchmarks
use):

- ``image``: the encoded file (JPEG/PNG/...), either ``binary`` or Hugging Face's
  ``struct<bytes: binary, path: string>``;
- ``label``: integer class index (any integer type), ``0 <= label < len(classes)``;
- ``path`` (optional, string): the source file, named in errors.

``classes.json``: a JSON list of class names in label order (``["cat", "dog"]``); a dict
``{"classes": [...]}`` is accepted too. ``python -m raytrain.pack SRC OUT`` writes this layout.

Pipeline
--------
Image folders: ``ray.data.range(tasks)`` -> one ``map_batches`` (``ListingRows``) whose task
``t`` takes its ``decode_batch`` rows of the epoch's permutation of the listing and decodes them
(one fused operator; no all-to-all shuffle). Parquet: ``read_parquet`` (file order shuffled per
epoch) -> ``map_batches(DecodeFn)``. Either way Ray Data's per-operator reservation is off
(``fast_context``: with it Ray 2.60 used half the CPUs). The tasks (``map_batches`` with a
function: tasks, not an actor pool -- an actor pool sized to the CPUs holds every CPU and the
read stage never runs, see the ingest notes) read and decode
with PIL, convert any mode (L, RGBA, CMYK, P, ...) to RGB and emit ``image`` uint8 ``[B, 3, N, N]``
and ``label`` int64. Training crops are torchvision's RandomResizedCrop (scale (0.08, 1), ratio
(3/4, 4/3)), drawn from a generator seeded by ``(seed, epoch, row)``: reproducible given the seed;
evaluation (and ``augment=False``) resizes the short side to ``N*256/224`` and center-crops N,
as one PIL resize over the crop box. JPEGs are opened in PIL's draft mode (DCT scaling by 1/2,
1/4, 1/8 while the crop stays >= N pixels): what it buys is measured in benchmarks/folder_ingest.py.
Flip, normalise and channels_last happen on the worker device (``raytrain.data.Augment``).

With ``decode_on_worker=True`` the tasks only fetch bytes and the worker decodes a batch with
``torchvision.io.decode_jpeg`` (nvjpeg when ``device`` is CUDA; see ``decode_batch``).

Epoch: the epoch used for seeding is Ray Data's execution index of the dataset (it counts the
executions of a pipeline; in Train each epoch's iteration is one execution of the shard's
dataset copy), read through ``ray_compat.data_execution_index`` (a private field).
"""

from __future__ import annotations

import io
import json
import math
import os
import posixpath
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from raytrain import ray_compat, storage
from raytrain.errors import ConfigError, RaytrainError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision.datasets.folder.IMG_EXTENSIONS (0.29), matched case-insensitively like it."""
DATASETS = ("imagefolder", "parquet")
VAL_SPLITS = ("val", "test")
RRC_SCALE, RRC_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
EVAL_RESIZE = 256 / 224


# ---------------------------------------------------------------------------- filesystems


def resolve_fs(data_dir: str):
    """(pyarrow filesystem, path inside it) for a local path or an s3:// / gs:// URI.

    pyarrow 26's S3FileSystem takes the endpoint from ``AWS_ENDPOINT_URL`` (checked by the S3
    test against a local moto server); credentials from the usual AWS variables/files.
    """
    return storage.resolve_fs(data_dir, "data_dir")


def _subdirs(fs, path: str) -> list[str]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory)


def _split_dirs(fs, root: str, data_dir: str) -> tuple[str, str]:
    import pyarrow.fs as pafs

    info = fs.get_file_info(root)
    # Object stores have no directories: a prefix with objects under it reads as one or not at all.
    subdirs = _subdirs(fs, root) if info.type != pafs.FileType.File else []
    if info.type == pafs.FileType.NotFound and not subdirs:
        raise ConfigError("data_dir", data_dir, "an existing directory")
    if "train" not in subdirs:
        raise ConfigError("data_dir", data_dir, "a directory with train/ and val/ (or test/) "
                          f"subdirectories; found {subdirs[:5] or 'none'}")
    val = next((s for s in VAL_SPLITS if s in subdirs), None)
    if val is None:
        raise ConfigError("data_dir", data_dir, "a directory with a val/ (or test/) split "
                          "beside train/")
    return "train", val


# ---------------------------------------------------------------------------- listing


@dataclass
class Listing:
    """What the driver lists once: class names and, per split, a small Arrow table."""

    class_names: list[str]
    tables: dict[str, Any]  # "train"/"val" -> pa.Table(path, label, row, size: file bytes)
    data_dir: str
    files: dict[str, list[str]] | None = None  # parquet: "train"/"val" -> sorted shard paths
    rows: dict[str, int] | None = None  # parquet: rows per split (from the footers)

    @property
    def counts(self) -> dict[str, int]:
        if self.rows is not None:
            return dict(self.rows)
        return {k: t.num_rows for k, t in self.tables.items()}


_LISTED: dict[tuple[str, str], Listing] = {}


def list_dataset(dataset: str, data_dir: str) -> Listing:
    """List (imagefolder) or check every footer (parquet) once; ``build_datasets`` reuses the
    result in the same process (then forgets it). Raises one-line ConfigErrors."""
    if dataset not in DATASETS:
        raise ConfigError("dataset", dataset, f"one of {', '.join(DATASETS)} for streaming")
    key = (dataset, data_dir)
    if key not in _LISTED:
        if dataset == "imagefolder":
            _LISTED[key] = list_image_folder(data_dir)
        else:
            names, files, rows = list_parquet(data_dir)
            _LISTED[key] = Listing(names, {}, data_dir, files=files, rows=rows)
    return _LISTED[key]


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _walk_local(split_path: str) -> dict[str, list[tuple[str, int]]]:
    """``_list_classes`` on a local/NFS path with ``os.scandir`` (torchvision's walk): 4x
    faster than pyarrow's FileInfo objects (benchmarks/listing.py: 110k files in 0.2 s)."""
    classes: dict[str, list[tuple[str, int]]] = {}
    with os.scandir(split_path) as top:
        dirs = sorted(e.name for e in top if e.is_dir(follow_symlinks=True))
    for cls in dirs:
        found, stack = [], [os.path.join(split_path, cls)]
        while stack:
            with os.scandir(stack.pop()) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=True):
                        stack.append(e.path)
                    elif _is_image(e.name):
                        found.append((e.path, e.stat().st_size))
        classes[cls] = sorted(found)
    return classes


def _list_classes(fs, split_path: str) -> dict[str, list[tuple[str, int]]]:
    """class folder -> sorted (image path, size in bytes), recursive like ImageFolder's walk."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        return _walk_local(split_path)
    infos = fs.get_file_info(pafs.FileSelector(split_path, recursive=True))
    prefix = split_path.rstrip("/") + "/"
    classes: dict[str, list[str]] = {c: [] for c in _subdirs(fs, split_path)}
    for info in infos:
        if info.type != pafs.FileType.File or not info.path.startswith(prefix):
            continue
        rel = info.path[len(prefix):]
        if "/" not in rel:  # a file directly under train/: ImageFolder ignores it too
            continue
        cls = rel.split("/", 1)[0]
        if _is_image(rel):
            classes.setdefault(cls, []).append((info.path, info.size or 0))
    return {c: sorted(p) for c, p in sorted(classes.items())}


def list_image_folder(data_dir: str) -> Listing:
    """List ``DIR/{train,val|test}/<class>/*`` once; one-line ConfigErrors for bad layouts."""
    import pyarrow as pa

    fs, root = resolve_fs(data_dir)
    splits = _split_dirs(fs, root, data_dir)
    per_split = {name: _list_classes(fs, f"{root}/{d}") for name, d in zip(("train", "val"),
                                                                            splits)}
    train_classes = sorted(per_split["train"])
    if not train_classes:
        raise ConfigError("data_dir", data_dir, f"class folders under {splits[0]}/ "
                          "(DIR/train/<class>/<image>)")
    for name, d in zip(("train", "val"), splits):
        empty = [c for c, paths in per_split[name].items() if not paths]
        if empty:
            raise ConfigError("data_dir", data_dir, f"image files ({', '.join(IMG_EXTENSIONS)}) "
                              f"in every class folder; {d}/{empty[0]}/ has none")
    extra = sorted(set(per_split["val"]) - set(train_classes))
    if extra:
        raise ConfigError("data_dir", data_dir, f"{splits[1]}/ classes that are all in train/; "
                          f"{splits[1]}/ has {extra[:3]} which train/ lacks")
    if not per_split["val"]:
        raise ConfigError("data_dir", data_dir, f"class folders under {splits[1]}/")
    index = {c: i for i, c in enumerate(train_classes)}
    tables = {}
    for name, classes in per_split.items():
        files = [f for c in sorted(classes) for f in classes[c]]
        labels = [index[c] for c in sorted(classes) for _ in classes[c]]
        tables[name] = pa.table({"path": pa.array([f[0] for f in files], pa.string()),
                                 "label": pa.array(labels, pa.int64()),
                                 "row": pa.array(np.arange(len(files)), pa.int64()),
                                 "size": pa.array([f[1] for f in files], pa.int64())})
    return Listing(train_classes, tables, data_dir)


def read_class_names(data_dir: str) -> list[str]:
    """``DIR/classes.json``: a list of names in label order (or ``{"classes": [...]}``)."""
    fs, root = resolve_fs(data_dir)
    try:
        with fs.open_input_stream(f"{root}/classes.json") as f:
            names = json.loads(f.read())
    except Exception as err:
        raise ConfigError("data_dir", data_dir, "a Parquet dataset with classes.json (a JSON list "
                          f"of class names in label order): {type(err).__name__}") from None
    if isinstance(names, dict):
        names = names.get("classes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError("data_dir", data_dir, "classes.json holding a non-empty JSON list of "
                          "class names")
    return names


def list_parquet(data_dir: str) -> tuple[list[str], dict[str, list[str]], dict[str, int]]:
    """(class names, split -> sorted Parquet file paths, split -> row count), schema checked."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, root = resolve_fs(data_dir)
    splits = _split_dirs(fs, root, data_dir)
    class_names = read_class_names(data_dir)
    files, counts = {}, {}
    for name, d in zip(("train", "val"), splits):
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/{d}", recursive=True))
        paths = sorted(i.path for i in infos if i.type == pafs.FileType.File
                       and i.path.lower().endswith(".parquet"))
        if not paths:
            raise ConfigError("data_dir", data_dir, f"*.parquet files under {d}/")
        n = 0
        for p in paths:
            meta = pq.ParquetFile(p, filesystem=fs)
            schema = meta.schema_arrow
            img = schema.field("image").type if "image" in schema.names else None
            ok_img = img is not None and (pa.types.is_binary(img) or pa.types.is_large_binary(img)
                                          or (pa.types.is_struct(img)
                                              and img.get_field_index("bytes") >= 0))
            if not ok_img or "label" not in schema.names or \
                    not pa.types.is_integer(schema.field("label").type):
                raise ConfigError("data_dir", data_dir, "Parquet files with columns image "
                                  "(binary, or struct{bytes, path}) and label (integer); "
                                  f"{d}/{posixpath.basename(p)} has {schema.names}")
            n += meta.metadata.num_rows
        files[name], counts[name] = paths, n
    return class_names, files, counts


# ---------------------------------------------------------------------------- transforms


def _epoch_index() -> int:
    """Ray Data's execution index of the running pipeline: the epoch (from 0) under Train."""
    return ray_compat.data_execution_index()


def crop_rng(seed: int, epoch: int, key: int) -> np.random.Generator:
    """The generator of one row's crop: a pure function of (seed, epoch, row key)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, epoch, key & 0xFFFFFFFFFFFF])


def rrc_params(width: int, height: int, rng: np.random.Generator,
               scale=RRC_SCALE, ratio=RRC_RATIO) -> tuple[float, float, float, float]:
    """torchvision RandomResizedCrop.get_params with a numpy generator: (left, top, w, h)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        ar = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * ar)))
        h = int(round(math.sqrt(target / ar)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    in_ratio = width / height  # fallback: whole image, clamped to the ratio range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def eval_box(width: int, height: int, size: int) -> tuple[float, float, float, float]:
    """Resize short side to size*256/224, center crop size: the box in source pixels."""
    short = min(width, height)
    side = short * size / int(size * EVAL_RESIZE)  # crop side in source pixels
    return (width - side) / 2, (height - side) / 2, side, side


def crop_box(width: int, height: int, size: int, train: bool, rng) -> tuple[float, ...]:
    return rrc_params(width, height, rng) if train else eval_box(width, height, size)


def open_image(data: bytes):
    """PIL image, with a one-line error for files PIL cannot identify."""
    from PIL import Image

    return Image.open(io.BytesIO(data))


def to_rgb(im):
    """Any PIL mode -> RGB, as torchvision's ``pil_loader`` does."""
    return im if im.mode == "RGB" else im.convert("RGB")


def decode_crop(data: bytes, size: int, train: bool, rng, draft: bool = True) -> np.ndarray:
    """Encoded image -> uint8 [size, size, 3] RGB crop (PIL; draft mode for JPEG)."""
    from PIL import Image

    im = open_image(data)
    full_w, full_h = im.size
    left, top, w, h = crop_box(full_w, full_h, size, train, rng)
    if draft and im.format == "JPEG":
        # Ask for a size at which the crop box still covers >= size pixels each way.
        want = (math.ceil(full_w * size / w), math.ceil(full_h * size / h))
        im.draft("RGB" if im.mode in ("RGB", "YCbCr") else im.mode, want)
    sx, sy = im.size[0] / full_w, im.size[1] / full_h
    im = to_rgb(im)
    box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    out = im.resize((size, size), Image.BILINEAR, box=box)
    return np.asarray(out, dtype=np.uint8)


def read_files(fs, paths) -> list[bytes]:
    """Whole files through a pyarrow filesystem; threads for object stores (latency-bound)."""
    import pyarrow.fs as pafs

    def one(p):
        with fs.open_input_stream(p) as f:
            return f.read()

    if not isinstance(fs, pafs.LocalFileSystem) and len(paths) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, paths))
    return [one(p) for p in paths]


def _image_bytes(col) -> list[bytes]:
    """An ``image`` column as bytes: binary values or HF's {bytes, path} structs."""
    return [v["bytes"] if isinstance(v, dict) else v for v in col]


def _key_of(batch: dict, i: int, data: bytes) -> int:
    if "row" in batch:
        return int(batch["row"][i])
    return zlib.crc32(data)  # Parquet rows have no index: the content keys the crop


NAME_BYTES = 256  # a bad image's name travels with its batch as the tail of its UTF-8 bytes


def bad_rows(column) -> list[tuple[int, str]]:
    """The ``bad`` column of a batch (uint8 [B, NAME_BYTES], zero rows for good images) ->
    (row, name) of each image that could not be decoded."""
    rows = np.asarray(column)
    return [(int(i), bytes(rows[i]).rstrip(b"\0").decode("utf-8", "replace"))
            for i in np.flatnonzero(rows.any(axis=1))]


def _name_row(name: str) -> np.ndarray:
    data = name.encode("utf-8")[-NAME_BYTES:] or b"?"
    return np.frombuffer(data.ljust(NAME_BYTES, b"\0"), np.uint8)


def _why(err: BaseException) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(err, UnidentifiedImageError):  # its message names an in-memory BytesIO
        return "not an image file PIL can read"
    return f"{type(err).__name__}: {str(err).strip()[:100]}"


class DecodeFn:
    """The Ray Data task function: rows (path or image bytes, label) -> uint8 crops.

    A plain picklable callable, run by ``map_batches`` as tasks (no ``concurrency``).
    ``bytes_only``: fetch the encoded bytes and pass them on (decoded on the worker).
    An image that cannot be decoded does not fail the task (Ray would retry it, then fail the
    worker, which Train restarts: the same file again, --max-failures times): its row is
    zeros and its name is in the ``bad`` column; the worker loop stops the run or skips it.
    """

    def __init__(self, fs, size: int, train: bool, seed: int,
                 bytes_only: bool = False, draft: bool = True):
        # The driver's filesystem object travels pickled: it keeps the endpoint and region the
        # driver resolved; credentials come from each node's own environment/instance profile.
        self.fs, self.size, self.train, self.seed = fs, size, train, seed
        self.bytes_only, self.draft = bytes_only, draft

    def __call__(self, batch: dict) -> dict:
        if "image" in batch:
            datas = _image_bytes(batch["image"])
        else:
            datas = read_files(self.fs, list(batch["path"]))
        n = len(datas)
        labels = np.asarray(batch["label"], dtype=np.int64)
        keys = np.array([_key_of(batch, i, datas[i]) for i in range(n)], dtype=np.int64)
        names = batch.get("path")
        epoch = _epoch_index()
        if self.bytes_only:
            return {"bytes": np.array(datas, dtype=object), "label": labels, "key": keys,
                    "epoch": np.full(n, epoch, np.int64),
                    "name": np.array([str(names[i]) if names is not None else f"row key "
                                      f"{keys[i]}" for i in range(n)], dtype=object)}
        out = np.zeros((n, self.size, self.size, 3), np.uint8)
        bad = np.zeros((n, NAME_BYTES), np.uint8)
        for i, data in enumerate(datas):
            try:
                out[i] = decode_crop(data, self.size, self.train,
                                     crop_rng(self.seed, epoch, int(keys[i])), self.draft)
            except Exception as err:  # PIL raises many kinds for a corrupt or truncated file
                name = names[i] if names is not None else f"row key {keys[i]}"
                bad[i] = _name_row(f"{name} ({_why(err)})")
        return {"image": np.ascontiguousarray(out.transpose(0, 3, 1, 2)), "label": labels,
                "bad": bad}


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
        order = self._order(_epoch_index())
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

    listing = list_dataset(dataset, data_dir)
    _LISTED.pop((dataset, data_dir), None)  # listed for this run; a later one lists again
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
                                       columns=_parquet_columns(fs, paths[0]))
            ds = ds.map_batches(fn, batch_size=decode_batch, batch_format="numpy")
        out[split] = fast_context(ds)
    return out, class_names, counts


def _parquet_columns(fs, path: str) -> list[str]:
    import pyarrow.parquet as pq

    names = pq.ParquetFile(path, filesystem=fs).schema_arrow.names
    return [c for c in ("image", "label", "path") if c in names]


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
        raise ConfigError("data_cpus", data_cpus, f"a positive number of CPUs left for Ray Data "
                          f"by {num_workers} workers x {cpus_per_worker:g} CPUs{runs} on a "
                          f"{cluster_cpus:g}-CPU cluster ({max(left, 0):g} left per run); use "
                          f"fewer workers or --cpus-per-worker {max((cluster_cpus / max(concurrent_runs, 1) - data_cpus) / num_workers, 0):.2g}")
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


# ---------------------------------------------------------------------------- worker side


def decode_batch(datas, size: int, train: bool, seed: int, epoch: int, keys, device="cpu",
                 names=None):
    """Encoded images -> (uint8 [B, 3, size, size] on ``device``, [(row, name)] of bad ones),
    with
    ``torchvision.io``.

    JPEGs are decoded together by ``decode_jpeg`` (one batched nvjpeg call when ``device`` is
    CUDA); other formats, or JPEGs it refuses (CMYK on GPU), by ``decode_image`` on the CPU.
    Crops use the same boxes as the CPU path, resized with antialiasing. An image neither can
    decode is zeros, and its row and name (``names[i]``) are in the returned list.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg
    from torchvision.transforms.v2.functional import resized_crop

    device = torch.device(device)
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    is_jpeg = [bytes(d[:2]) == b"\xff\xd8" for d in datas]
    images: list = [None] * len(datas)
    jpeg_idx = [i for i, j in enumerate(is_jpeg) if j]
    if jpeg_idx:
        try:
            decoded = decode_jpeg([tensors[i] for i in jpeg_idx], mode=ImageReadMode.RGB,
                                  device=device)
            for i, img in zip(jpeg_idx, decoded):
                images[i] = img
        except RuntimeError:
            pass  # fall back to one at a time below
    out = torch.zeros((len(datas), 3, size, size), dtype=torch.uint8, device=device)
    bad = []
    for i, img in enumerate(images):
        try:
            if img is None:
                img = decode_image(tensors[i], mode=ImageReadMode.RGB).to(device)
            h, w = img.shape[-2:]
            left, top, cw, ch = crop_box(w, h, size, train, crop_rng(seed, epoch, int(keys[i])))
            t, l = int(round(top)), int(round(left))
            out[i] = resized_crop(img, t, l, max(1, int(round(ch))), max(1, int(round(cw))),
                                  [size, size], antialias=True)
        except RuntimeError as err:
            name = names[i] if names is not None else f"row key {keys[i]}"
            bad.append((i, f"{name} ({_why(err)})"))
    return out, bad


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
    from a Train
    dataset shard.

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
        self.listing = list_dataset(dataset, data_dir)
        _LISTED.pop((dataset, data_dir), None)
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
            cols = [c for c in ("image", "label", "path") if c in f.schema_arrow.names]
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
