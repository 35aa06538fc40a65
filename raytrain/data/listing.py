"""Listing a streamed dataset once, on the driver: the class folders of an image folder, or
the shards and footers of a Parquet dataset, checked with one-line errors.

    listing = list_dataset("imagefolder", "s3://bucket/imagenet")   # or list_image_folder(DIR)
    listing.class_names, listing.counts    # ["cat", ...], {"train": n, "val": n}

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

No torch and no Ray here: preflight lists before anything starts.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

import numpy as np

from raytrain import storage
from raytrain.errors import ConfigError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision.datasets.folder.IMG_EXTENSIONS (0.29), matched case-insensitively like it."""
DATASETS = ("imagefolder", "parquet")
VAL_SPLITS = ("val", "test")
PARQUET_COLUMNS = ("image", "label", "path")  # what the decode reads of a shard, if present


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


def take_listing(dataset: str, data_dir: str) -> Listing:
    """``list_dataset``'s result for one run (preflight's, if it listed), then forgotten: a
    later run lists again and sees files added since."""
    listing = list_dataset(dataset, data_dir)
    _LISTED.pop((dataset, data_dir), None)
    return listing


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
    names = class_list(names)
    if names is None:
        raise ConfigError("data_dir", data_dir, "classes.json holding a non-empty JSON list of "
                          "class names")
    return names


def class_list(names) -> list[str] | None:
    """A classes.json's parsed content (a list of names in label order, or
    ``{"classes": [...]}``) as that list; None when it is not one."""
    if isinstance(names, dict):
        names = names.get("classes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return None
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


def parquet_columns(fs, path: str) -> list[str]:
    """The columns of a shard the decode reads (``path`` only where the shard has it)."""
    import pyarrow.parquet as pq

    names = pq.ParquetFile(path, filesystem=fs).schema_arrow.names
    return [c for c in PARQUET_COLUMNS if c in names]
