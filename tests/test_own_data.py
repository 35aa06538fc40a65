"""Your own images through ``python -m raytrain.fit``: image folders and Parquet shards streamed
by Ray Data to real DDP workers on the session's 2-CPU Ray cluster (issue 17).

Real data: the bundled digits written as image files of mixed sizes, modes and formats, with
stray non-image files; 359 val images, which no worker count here divides.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from raytrain import evaluate
from raytrain.data import load_dataset
from tests.helpers import fit_in_process, metrics, upload_folder, wait_for_epoch

N_VAL = 359
MODES = [("L", ".png", 32), ("RGB", ".jpg", 40), ("RGBA", ".png", 28), ("P", ".png", 36),
         ("CMYK", ".JPEG", 48), ("RGB", ".Png", 32), ("L", ".jpeg", 24)]


def write_digits_folder(root, per_class: int | None = None, n_val: int = N_VAL) -> str:
    """digits as DIR/train/<d>/*, DIR/val/<d>/* in every mode/format/size of MODES, plus
    files an image folder must ignore."""
    from PIL import Image

    data = load_dataset("digits")
    splits = {"train": (data.train_x, data.train_y), "val": (data.test_x[:n_val],
                                                             data.test_y[:n_val])}
    for split, (xs, ys) in splits.items():
        taken: dict[int, int] = {}
        for i, (x, y) in enumerate(zip(xs.permute(0, 2, 3, 1).numpy(), ys.tolist())):
            if per_class is not None and taken.get(y, 0) >= (per_class if split == "train"
                                                             else max(2, per_class // 4)):
                continue
            taken[y] = taken.get(y, 0) + 1
            mode, ext, size = MODES[i % len(MODES)]
            folder = os.path.join(root, split, str(y))
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(x).resize((size, size + i % 5)).convert(mode).save(
                os.path.join(folder, f"{i:04d}{ext}"))
    for stray in ("train/.DS_Store", "train/3/notes.txt", "val/README"):
        with open(os.path.join(root, stray), "w") as f:
            f.write("not an image")
    return str(root)


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    return write_digits_folder(tmp_path_factory.mktemp("digits-folder"))


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    """10 classes x 12 train images (val: 3 per class)."""
    return write_digits_folder(tmp_path_factory.mktemp("small-folder"), per_class=12)


_fit = fit_in_process  # raytrain.fit.main here: rc, stdout, stderr


def _events(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_image_folder_run_learns_counts_every_val_image_and_evaluates(ray_cluster, digits_folder,
                                                                     tmp_path, capsys):
    rc, out, err = _fit("--dataset", "imagefolder", "--data-dir", digits_folder,
                        "--image-size", "32", "--num-workers", "2", "--epochs", "3",
                        "--progress-every", "0.5", "--storage-path", str(tmp_path),
                        "--name", "folder")
    assert rc == 0, err
    run_dir = tmp_path / "folder"
    rows = metrics(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    # every val image once, across 2 workers (359 is odd); train: equal steps on both ranks
    assert all(r["test_count"] == N_VAL for r in rows)
    assert all(r["train_count"] == 1437 // 2 // 64 * 64 * 2 for r in rows)
    assert rows[-1]["test_acc"] > 0.5, rows  # chance is 0.10
    assert all(0 <= r["data_wait"] <= 1 and r["first_batch_s"] > 0 for r in rows)
    assert json.loads((run_dir / "classes.json").read_text()) == [str(d) for d in range(10)]
    assert "data: first batch" in out and "workers waited for data" in out
    later = max(r["first_batch_s"] for r in rows[1:])  # each epoch is a new Ray Data pass
    assert f"at most {later:.2f}s into a later one" in out, out
    progress = [e["text"] for e in _events(run_dir) if e.get("event") == "log"]
    assert any("images/s, ETA" in t for t in progress), progress
    # model.pt: a plain state_dict; evaluate reads the same val split (no Ray) to the same score
    assert all(isinstance(v, torch.Tensor) for v in
               torch.load(run_dir / "model.pt", weights_only=True).values())
    capsys.readouterr()
    assert evaluate.main([str(run_dir)]) == 0
    said = capsys.readouterr().out
    assert f"test_acc {rows[-1]['test_acc']:.4f}" in said and f"({N_VAL} images" in said


def test_parquet_from_pack_gives_the_same_counts_with_worker_side_decode(ray_cluster,
                                                                         digits_folder, tmp_path):
    from raytrain import pack

    shards = str(tmp_path / "shards")
    assert pack.pack(digits_folder, shards, shard_mb=0.5) == {"train": 1437, "val": N_VAL}
    assert len(os.listdir(os.path.join(shards, "train"))) > 1  # ~0.5 MB shards
    rc, _, err = _fit("--dataset", "parquet", "--data-dir", shards, "--image-size", "32",
                      "--num-workers", "2", "--epochs", "2", "--decode", "worker",
                      "--storage-path", str(tmp_path), "--name", "pq")
    assert rc == 0, err
    rows = metrics(tmp_path / "pq")
    assert [r["epoch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["test_count"] == N_VAL and row["train_count"] == 1437 // 2 // 64 * 64 * 2
    # Above chance (0.1); one epoch of 22 steps gave 0.17-0.3 (streamed runs are not bit-exact)
    assert rows[-1]["test_acc"] > 0.2


def _layout(root, case: str) -> str:
    """A broken dataset directory (``case``) under ``root``."""
    from PIL import Image

    def img(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.new("RGB", (8, 8)).save(path)

    d = str(root / case)
    if case == "missing":
        return d
    if case == "no_train":
        img(f"{d}/images/a/1.png")
    if case == "no_classes":
        os.makedirs(f"{d}/train")
        os.makedirs(f"{d}/val")
    if case == "empty_class":
        img(f"{d}/train/a/1.png")
        os.makedirs(f"{d}/train/b")
        img(f"{d}/val/a/1.png")
    if case == "val_not_subset":
        img(f"{d}/train/a/1.png")
        img(f"{d}/val/z/1.png")
    if case == "parquet_columns":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for split in ("train", "val"):
            os.makedirs(f"{d}/{split}")
            pq.write_table(pa.table({"jpg": [b"x"], "cls": [0]}), f"{d}/{split}/0.parquet")
        with open(f"{d}/classes.json", "w") as f:
            json.dump(["a"], f)
    return d


@pytest.mark.parametrize("case,says", [
    ("missing", "an existing directory"), ("no_train", "train/ and val/"),
    ("no_classes", "class folders"), ("empty_class", "train/b/ has none"),
    ("val_not_subset", "which train/ lacks"), ("parquet_columns", "columns image")])
def test_bad_layouts_are_one_line_exit_2_before_ray_starts(tmp_path, case, says):
    import ray

    dataset = "parquet" if case.startswith("parquet") else "imagefolder"
    started = ray.is_initialized()
    rc, out, err = _fit("--dataset", dataset, "--data-dir", _layout(tmp_path, case),
                        "--storage-path", str(tmp_path / "runs"), "--name", "bad")
    assert rc == 2 and "--data-dir" in err and says in err, err
    assert len(err.strip().splitlines()) == 1
    assert ray.is_initialized() == started  # refused before any Ray process starts
    assert not os.path.exists(tmp_path / "runs" / "bad")


def test_model_that_cannot_take_the_size_is_one_line(tmp_path, small_folder):
    rc, _, err = _fit("--dataset", "imagefolder", "--data-dir", small_folder, "--model",
                      "seed-cnn", "--image-size", "64", "--batch-size", "16",
                      "--storage-path", str(tmp_path))
    assert rc == 2 and "--image-size" in err and "seed-cnn" in err and \
        len(err.strip().splitlines()) == 1


def test_corrupt_image_stops_the_run_naming_it_or_is_skipped(ray_cluster, small_folder,
                                                             tmp_path):
    import shutil

    folder = str(tmp_path / "corrupt")
    shutil.copytree(small_folder, folder)
    victim = os.path.join(folder, "train", "4", "broken.jpg")
    with open(os.path.join(folder, "train", "4", sorted(os.listdir(
            os.path.join(folder, "train", "4")))[0]), "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:  # a JPEG header and nothing decodable after it
        f.write(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    common = ["--dataset", "imagefolder", "--data-dir", folder, "--image-size", "32",
              "--num-workers", "2", "--batch-size", "16", "--epochs", "2",
              "--storage-path", str(tmp_path)]
    rc, _, err = _fit(*common, "--name", "stops")
    assert rc == 1 and "--skip-bad-images" in err, err
    (line,) = [line for line in err.splitlines() if "broken.jpg" in line]  # one line says it
    assert "cannot decode image" in line and "epoch 1" in line
    assert not [d for d in os.listdir(tmp_path / "stops") if d.startswith("checkpoint_")]
    assert data  # the folder's other images are intact JPEG/PNG files

    rc, _, err = _fit(*common, "--name", "skips", "--skip-bad-images")
    assert rc == 0, err
    rows = metrics(tmp_path / "skips")
    assert [r["epoch"] for r in rows] == [1, 2]
    assert sum(r.get("bad_images", 0) for r in rows) == 2  # once per epoch (train split)
    named = [e for e in _events(tmp_path / "skips") if e.get("event") == "bad_image"]
    assert len(named) == 2 and all("broken.jpg" in e["image"] for e in named)


def test_killed_worker_on_an_image_folder_run_resumes_each_epoch_once(ray_cluster,
                                                                      digits_folder, tmp_path):
    from tests.test_fault_tolerance import _train_workers

    address = ray_cluster.address_info["gcs_address"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrain.fit", "--address", address, "--dataset",
         "imagefolder", "--data-dir", digits_folder, "--image-size", "32", "--num-workers",
         "2", "--epochs", "4", "--max-failures", "2", "--storage-path", str(tmp_path),
         "--name", "kill"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_epoch(tmp_path / "kill", 2, proc)
        victims = _train_workers(address)
        assert len(victims) == 2
        victims[-1].send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    rows = metrics(tmp_path / "kill")
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]
    assert all(r["test_count"] == N_VAL for r in rows)
    resumed = [r["resumed_from"] for r in rows if r.get("resumed_from")]
    assert resumed and resumed[0] >= 2, out


def test_tune_searches_on_an_image_folder(ray_cluster, small_folder, tmp_path):
    rc, out, err = _fit("--tune", "--dataset", "imagefolder", "--data-dir", small_folder,
                        "--image-size", "32", "--num-workers", "1", "--epochs", "1",
                        "--num-samples", "1", "--lr-range", "0.01,0.1", "--batch-sizes", "16",
                        "--scheduler", "none", "--storage-path", str(tmp_path), "--name", "tn")
    assert rc == 0, err
    import csv

    with open(tmp_path / "tn" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["status"] == "completed" and
                                  float(r["final_test_acc"]) > 0 for r in rows), rows
    assert np.isclose(sorted(float(r["lr"]) for r in rows), [0.01, 0.1]).all()


MEMORY_RUN = """
import sys
import ray
# An object store of 80 MiB (Ray's minimum is 75): the decoded dataset is ~3x that.
ray.init(address="local", num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
         logging_level="ERROR")
from raytrain import fit
try:
    sys.exit(fit.main(sys.argv[1:]))
finally:
    ray.shutdown()
"""


def test_streams_a_dataset_several_times_the_object_store_with_bounded_worker_memory(tmp_path):
    """84,000 digit JPEGs as Parquet rows (the 1,437 train images repeated): 241 MiB decoded at
    32x32 through an 80 MiB object store, on a Ray cluster of its own (its own store size)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    data = load_dataset("digits")
    encoded = []
    for x in data.train_x.permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(x).save(buf, format="JPEG", quality=90)
        encoded.append(buf.getvalue())
    labels = data.train_y.tolist()
    repeats, root = 58, tmp_path / "big"
    for split, n_files, reps in (("train", 8, repeats), ("val", 1, 1)):
        os.makedirs(root / split)
        rows = len(encoded) * reps // n_files
        for f in range(n_files):
            idx = [(f * rows + i) % len(encoded) for i in range(rows)]
            pq.write_table(pa.table({"image": [encoded[i] for i in idx],
                                     "label": pa.array([labels[i] for i in idx], pa.int64())}),
                           root / split / f"{f:02d}.parquet")
    (root / "classes.json").write_text(json.dumps([str(d) for d in range(10)]))
    n_train = len(encoded) * repeats // 8 * 8
    assert n_train * 3 * 32 * 32 > 3 * 80 * 2**20  # decoded: over 3x the object store
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_RUN, "--dataset", "parquet", "--data-dir", str(root),
         "--image-size", "32", "--model", "lenet", "--num-workers", "2", "--batch-size", "512",
         "--epochs", "1", "--storage-path", str(tmp_path / "runs"), "--name", "big"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "runs" / "big")
    assert [r["train_count"] for r in rows] == [n_train // 2 // 256 * 256 * 2]
    # Neither worker held the data (241 MiB decoded): a worker's peak memory is that of torch
    # + Ray + a few batches in flight (benchmarks/folder_ingest.py: flat across epochs).
    # A worker holding its half of the data would grow by 120 MiB over the epoch.
    print("worker peak RSS MiB", rows[0]["worker_rss_mb"], "growth over the epoch",
          rows[0]["worker_rss_growth_mb"])
    assert rows[0]["worker_rss_growth_mb"] < 60 and rows[0]["worker_rss_mb"] < 2048, rows


def test_trains_from_an_image_folder_in_a_bucket(ray_cluster, s3_server, small_folder,
                                                 tmp_path):
    """--data-dir s3://...: listed by the driver, read by Ray Data's tasks (their credentials
    and endpoint from the environment, as every node of a cluster has them), one epoch."""
    uri = upload_folder(small_folder, "own-images", "digits")
    rc, _, err = _fit("--dataset", "imagefolder", "--data-dir", uri,
                      "--image-size", "32", "--num-workers", "1", "--batch-size", "16",
                      "--epochs", "1", "--storage-path", str(tmp_path), "--name", "s3data")
    assert rc == 0, err
    (row,) = metrics(tmp_path / "s3data")
    local = len([f for _, _, fs in os.walk(os.path.join(small_folder, "val")) for f in fs
                 if f != "README"])
    assert row["test_count"] == local and row["train_count"] == 120 // 16 * 16
