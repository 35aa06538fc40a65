"""Pack an image folder into Parquet shards with Ray Data: ``python -m raytrain.pack SRC OUT``.

    python -m raytrain.pack /mnt/data/imagenet /mnt/data/imagenet-parquet --short-side 256
    python -m raytrain.pack --from digits ./digits-folder    # the bundled digits as PNG files

SRC is an image folder (``SRC/train/<class>/*``, ``SRC/val|test/<class>/*``, local or s3://,
gs://); OUT gets ``train/*.parquet``, ``val/*.parquet`` and ``classes.json`` in the layout
``raytrain.data.listing`` documents (columns ``image`` binary, ``label`` int64, ``path`` string).
Reading and re-encoding run as Ray Data tasks on every CPU of the cluster. Train rows are written
in a shuffled order (seed 0) so that file-level shuffling while training mixes classes.
``--short-side N`` shrinks images whose short side is above N (never enlarges) and re-encodes
them as JPEG quality 90; without it the files' bytes are stored unchanged. Shards hold about
``--shard-mb`` MB (default 256), estimated from the listed file sizes (or a resized sample).
"""

from __future__ import annotations

import argparse
import io
import json
import sys

import numpy as np

from raytrain.data.decode import open_image, read_files, to_rgb
from raytrain.data.listing import Listing, list_image_folder, resolve_fs
from raytrain.data.pipeline import listing_dataset
from raytrain.errors import RaytrainError


def shrink(data: bytes, short_side: int | None, quality: int = 90) -> bytes:
    """The image's bytes, or a JPEG whose short side is ``short_side`` if it was larger."""
    if not short_side:
        return data
    from PIL import Image

    im = open_image(data)
    w, h = im.size
    if min(w, h) <= short_side and im.format == "JPEG":
        return data
    scale = min(1.0, short_side / min(w, h))
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    if im.format == "JPEG":
        im.draft("RGB" if im.mode in ("RGB", "YCbCr") else im.mode, size)
    im = to_rgb(im).resize(size, Image.BILINEAR, reducing_gap=3.0)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


class PackFn:
    """Ray Data task: listing rows -> (image bytes, label, path relative to SRC)."""

    def __init__(self, fs, root: str, short_side: int | None):
        self.fs, self.root, self.short_side = fs, root.rstrip("/") + "/", short_side

    def __call__(self, batch: dict) -> dict:
        paths = list(batch["path"])
        datas = read_files(self.fs, paths)
        out = []
        for p, d in zip(paths, datas):
            try:
                out.append(shrink(d, self.short_side))
            except Exception as err:
                raise RaytrainError(f"cannot decode image {p}: {type(err).__name__}") from None
        rel = [p[len(self.root):] if p.startswith(self.root) else p for p in paths]
        return {"image": np.array(out, dtype=object),
                "label": np.asarray(batch["label"], np.int64),
                "path": np.array(rel, dtype=object)}


def rows_per_shard(table, fs, shard_mb: float, short_side: int | None) -> int:
    """Rows per file for ~shard_mb MB: mean listed size, or a resized sample's mean size."""
    sizes = np.asarray(table.column("size"))
    mean = float(sizes.mean()) if len(sizes) else 1.0
    if short_side and len(sizes):
        idx = np.linspace(0, len(sizes) - 1, min(16, len(sizes))).astype(int)
        paths = [table.column("path")[int(i)].as_py() for i in idx]
        sample = [shrink(d, short_side) for d in read_files(fs, paths)]
        mean = float(np.mean([len(s) for s in sample]))
    return max(1, int(shard_mb * 2**20 / max(mean, 1.0)))


def pack(src: str, out: str, short_side: int | None = None, shard_mb: float = 256,
         seed: int = 0, listing: Listing | None = None) -> dict[str, int]:
    """Write OUT/{train,val}/*.parquet and OUT/classes.json; returns rows per split."""

    listing = listing or list_image_folder(src)
    src_fs, src_root = resolve_fs(src)
    out_fs, out_root = resolve_fs(out)
    out_fs.create_dir(out_root, recursive=True)
    for split, table in listing.tables.items():
        ds = listing_dataset(table, 32, shuffle=split == "train", seed=seed,
                             fn=PackFn(src_fs, src_root, short_side))
        per_file = rows_per_shard(table, src_fs, shard_mb, short_side)
        ds.write_parquet(f"{out_root}/{split}", filesystem=out_fs,
                         min_rows_per_file=per_file, max_rows_per_file=per_file)
    with out_fs.open_output_stream(f"{out_root}/classes.json") as f:
        f.write(json.dumps(listing.class_names, indent=1).encode())
    return listing.counts


def export_digits(out: str) -> dict[str, int]:
    """The bundled digits as an image folder: OUT/{train,val}/<digit>/<n>.png, 32x32 RGB, the
    same images and 80/20 split as ``--dataset digits`` (a real dataset, no download)."""
    import os

    from PIL import Image

    from raytrain.data import load_dataset

    data = load_dataset("digits")
    counts = {}
    for split, xs, ys in (("train", data.train_x, data.train_y), ("val", data.test_x,
                                                                   data.test_y)):
        for i, (x, y) in enumerate(zip(xs.permute(0, 2, 3, 1).numpy(), ys.tolist())):
            folder = os.path.join(out, split, str(y))
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(x).save(os.path.join(folder, f"{i:04d}.png"))
        counts[split] = len(ys)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrain.pack", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", nargs="?", help="image folder: SRC/train/<class>/*, "
                        "SRC/val/<class>/*")
    parser.add_argument("out", help="output directory (local, s3:// or gs://)")
    parser.add_argument("--from", dest="bundled", choices=("digits",), default=None,
                        help="write a bundled dataset as an image folder into OUT instead "
                        "(no SRC): digits = scikit-learn's 1,797 digits as 32x32 PNGs")
    parser.add_argument("--short-side", type=int, default=None,
                        help="shrink images whose short side is larger (JPEG q90)")
    parser.add_argument("--shard-mb", type=float, default=256, help="target MB per shard")
    parser.add_argument("--address", default=None, help="Ray cluster (default: a new local one)")
    args = parser.parse_args(argv)
    if args.bundled:
        if args.src is not None:
            parser.error("--from digits takes OUT only (no SRC)")
        counts = export_digits(args.out)
        print(f"wrote {counts['train']} train and {counts['val']} val images of {args.bundled} "
              f"into {args.out}")
        return 0
    if args.src is None:
        parser.error("SRC and OUT are required (or --from digits OUT)")
    import ray

    from raytrain import ray_compat

    try:
        listing = list_image_folder(args.src)  # bad layouts fail before Ray starts
    except RaytrainError as err:
        print(f"error: {str(err).replace('--data-dir', 'SRC', 1)}", file=sys.stderr)
        return 2
    try:
        if args.address:
            ray.init(address=args.address, logging_level="ERROR")
        else:
            ray_compat.init_local(logging_level="ERROR")
        counts = pack(args.src, args.out, args.short_side, args.shard_mb, listing=listing)
    except RaytrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        ray_compat.shutdown()
    print(f"packed {counts['train']} train and {counts['val']} val images into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
