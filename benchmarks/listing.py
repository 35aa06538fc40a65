"""Listing a large image folder: raytrain's one-pass listing vs torchvision's ImageFolder scan,
time and memory, on a generated tree of empty ``.jpg`` files (listing reads no pixels).

    python benchmarks/listing.py                  # 100,000 files in 1,000 class folders
    python benchmarks/listing.py --quick          # 2,000 files

Ray issues #40686/#55760: ``read_images`` over a folder of millions of files spends minutes
listing and carries GBs of path metadata. raytrain lists once on the driver (``os.scandir``
and one ``stat`` per file on a local/NFS path; one recursive pyarrow ``get_file_info`` on a
bucket) into a small Arrow table (path, label, row, size), which the decode tasks get once
through the object store (``raytrain.data.pipeline.ListingRows``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytrain.data.listing import list_image_folder  # noqa: E402


def generate(root: str, files: int, classes: int) -> None:
    per = files // classes
    for split, n in (("train", per), ("val", max(1, per // 10))):
        for c in range(classes):
            d = os.path.join(root, split, f"n{c:08d}")
            os.makedirs(d, exist_ok=True)
            for i in range(n):
                open(os.path.join(d, f"n{c:08d}_{i:06d}.JPEG"), "wb").close()


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def timed(fn):
    gc.collect()
    before = rss_mb()
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t, rss_mb() - before


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=100_000, help="train files (val adds 10%%)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--data", default=None, help="reuse/generate the tree here")
    p.add_argument("--quick", action="store_true", help="2,000 files in 100 classes")
    a = p.parse_args(argv)
    if a.quick:
        a.files, a.classes = 2000, 100
    root = a.data or tempfile.mkdtemp(prefix="raytrain-listing-")
    if not os.path.isdir(os.path.join(root, "train")):
        t = time.perf_counter()
        generate(root, a.files, a.classes)
        print(f"generated {a.files} + {a.files // 10} empty files in {root} "
              f"({time.perf_counter() - t:.0f} s)")
    import pandas  # noqa: F401 - imports are not listing (pyarrow's tables load pandas)
    import pyarrow.fs  # noqa: F401
    import torchvision.datasets  # noqa: F401

    listing, t_rt, mem_rt = timed(lambda: list_image_folder(root))
    table_mb = sum(t.nbytes for t in listing.tables.values()) / 2**20

    def torchvision_scan():
        from torchvision.datasets import ImageFolder

        return [ImageFolder(os.path.join(root, s), loader=lambda p: p) for s in ("train", "val")]

    folders, t_tv, mem_tv = timed(torchvision_scan)
    n = sum(listing.counts.values())
    assert n == sum(len(f.samples) for f in folders), "the two listings disagree"
    print(f"{n} files in {a.classes} classes x 2 splits")
    print(f"{'lister':44s} | seconds | RSS growth MB | result MB")
    print(f"{'raytrain list_image_folder (scandir + stat)':44s} | {t_rt:7.2f} | {mem_rt:13.0f} | "
          f"{table_mb:9.1f}")
    print(f"{'torchvision ImageFolder (os.scandir walk)':44s} | {t_tv:7.2f} | {mem_tv:13.0f} | "
          f"{'-':>9s}")
    print(f"per 1M files, extrapolated: raytrain {t_rt / n * 1e6:.0f} s, "
          f"{table_mb / n * 1e6:.0f} MB of listing")


if __name__ == "__main__":
    main()
