"""Streaming datasets through Ray Data: real Ray (2 CPUs), real image files, CPU only."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading

import numpy as np
import pytest
import torch

from raytrain.errors import ConfigError
from raytrain.data.decode import rrc_params
from raytrain.data.listing import list_image_folder
from raytrain.data.pipeline import (build_datasets, check_data_cpus, data_config, listing_dataset,
                                    reserve_data_cpus, steps_per_epoch)
from raytrain.data.sources import iter_batches
from tests.helpers import upload_folder

SIZE = 16
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ray_local(ray_cluster):
    """The session's real local Ray cluster (2 CPUs). Ray Data's tasks need no S3 environment:
    the pyarrow S3FileSystem the driver resolved travels pickled with its endpoint and keys."""
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    yield


def write_image(path: str, pixels: np.ndarray, mode: str, size: tuple[int, int]) -> None:
    """One 8x8 digit as an image file of ``size`` and PIL ``mode`` (format from the name)."""
    from PIL import Image

    gray = Image.fromarray((pixels * 15).astype(np.uint8), "L").resize(size, Image.BILINEAR)
    rgb = Image.merge("RGB", (gray, gray.point(lambda v: 255 - v), gray))
    im = {"L": gray, "RGB": rgb, "RGBA": rgb.convert("RGBA"), "CMYK": rgb.convert("CMYK"),
          "P": rgb.convert("P", palette=Image.ADAPTIVE, colors=16)}[mode]
    im.save(path)


FORMATS = [("L", ".png"), ("RGB", ".jpg"), ("RGBA", ".png"), ("CMYK", ".JPEG"), ("P", ".png"),
           ("RGB", ".Png"), ("L", ".jpeg")]


def make_folder(root, n_train_per_class=6, n_val=(3, 2, 2), classes=("one", "three", "zero"),
                digits=(1, 3, 0), val_dir="val") -> str:
    """DIR/train/<class>/*, DIR/<val_dir>/<class>/* of scikit-learn digits in mixed sizes,
    modes and extensions, plus junk files ImageFolder ignores. Val count 7: odd, prime."""
    from sklearn.datasets import load_digits

    d = load_digits()
    rng = np.random.default_rng(0)
    root = str(root)
    k = 0
    for split, counts in (("train", [n_train_per_class] * len(classes)), (val_dir, n_val)):
        for cls, digit, count in zip(classes, digits, counts):
            folder = os.path.join(root, split, cls)
            os.makedirs(folder, exist_ok=True)
            imgs = d.images[d.target == digit]
            for i in range(count):
                mode, ext = FORMATS[k % len(FORMATS)]
                size = (int(rng.integers(12, 48)), int(rng.integers(12, 48)))
                write_image(os.path.join(folder, f"img{i:03d}{ext}"), imgs[i + 7 * (split != "train")],
                            mode, size)
                k += 1
            open(os.path.join(folder, ".DS_Store"), "wb").write(b"\0\1junk")
            open(os.path.join(folder, "notes.txt"), "w").write("not an image")
    open(os.path.join(root, "train", "README.txt"), "w").write("stray")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("imgs"))


def run_with_timeout(fn, *args, timeout=TIMEOUT_S):
    """Run fn in a thread; fail (not hang) when it takes longer than ``timeout`` seconds."""
    result, error = [], []

    def target():
        try:
            result.append(fn(*args))
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            error.append(err)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} did not finish within {timeout} s"
    if error:
        raise error[0]
    return result[0]


def rows(ds) -> list[dict]:
    return list(ds.iter_rows())


def digest(image) -> str:
    return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


# ---------------------------------------------------------------------------- listing


def test_listing_matches_torchvision_imagefolder(folder):
    from torchvision.datasets import ImageFolder

    listing = list_image_folder(folder)
    for split in ("train", "val"):
        tv = ImageFolder(os.path.join(folder, split))
        assert listing.class_names == tv.classes if split == "train" else True
        table = listing.tables[split]
        ours = list(zip(table.column("path").to_pylist(), table.column("label").to_pylist()))
        assert ours == [(p, y) for p, y in tv.samples]
    assert listing.counts == {"train": 18, "val": 7}


def test_test_dir_accepted_for_val(tmp_path):
    root = make_folder(tmp_path, val_dir="test")
    assert list_image_folder(root).counts["val"] == 7


@pytest.mark.parametrize("case, needle", [
    ("missing", "an existing directory"),
    ("no_train", "train/"),
    ("no_val", "val/"),
    ("no_classes", "class folders"),
    ("empty_class", "has none"),
    ("val_extra_class", "which train/ lacks"),
])
def test_listing_errors_are_one_line_naming_data_dir(tmp_path, case, needle):
    root = tmp_path / "data"
    if case != "missing":
        make_folder(root, n_train_per_class=1, n_val=(1, 1, 1))
    if case == "no_train":
        os.rename(root / "train", root / "training")
    elif case == "no_val":
        os.rename(root / "val", root / "holdout")
    elif case == "no_classes":
        for c in os.listdir(root / "train"):
            if os.path.isdir(root / "train" / c):
                for f in os.listdir(root / "train" / c):
                    os.remove(root / "train" / c / f)
                os.rmdir(root / "train" / c)
    elif case == "empty_class":
        for f in os.listdir(root / "train" / "one"):
            if f.startswith("img"):
                os.remove(root / "train" / "one" / f)
    elif case == "val_extra_class":
        os.makedirs(root / "val" / "seven")
        write_image(str(root / "val" / "seven" / "a.png"), np.ones((8, 8)), "L", (8, 8))
    with pytest.raises(ConfigError) as err:
        list_image_folder(str(root))
    msg = str(err.value)
    assert msg.startswith("--data-dir") and "\n" not in msg and needle in msg, msg


def test_bad_dataset_name():
    with pytest.raises(ConfigError, match="--dataset"):
        build_datasets("tfrecords", "/nowhere", 32)


# ---------------------------------------------------------------------------- pipeline


def test_pipeline_shapes_dtypes_labels(ray_local, folder):
    datasets, names, counts = build_datasets("imagefolder", folder, SIZE, seed=0)
    assert names == ["one", "three", "zero"] and counts == {"train": 18, "val": 7}
    listing = list_image_folder(folder)
    for split in ("train", "val"):
        got = run_with_timeout(rows, datasets[split])
        assert len(got) == counts[split]
        assert all(r["image"].shape == (3, SIZE, SIZE) and r["image"].dtype == np.uint8
                   for r in got)
        assert sorted(int(r["label"]) for r in got) == \
            sorted(listing.tables[split].column("label").to_pylist())
    # Through iter_batches as a worker would: torch uint8 NCHW + int64 on the device.
    # (Ray 2.60 may hand over the short last batch first: batches are formatted in threads.)
    got = list(iter_batches(datasets["val"].iterator(), 4, "cpu", train=False))
    assert sorted(len(y) for _, y, _ in got) == [3, 4]
    assert all(x.dtype == torch.uint8 and x.shape[1:] == (3, SIZE, SIZE)
               and y.dtype == torch.int64 for x, y, _ in got)


def test_eval_crops_are_deterministic_and_no_augment_uses_them(ray_local, folder):
    datasets, _, _ = build_datasets("imagefolder", folder, SIZE, augment=False)
    first = sorted(digest(r["image"]) for r in run_with_timeout(rows, datasets["val"]))
    again = sorted(digest(r["image"]) for r in run_with_timeout(rows, datasets["val"]))
    assert first == again
    # --no-augment: the train split gets the eval transform, the same every epoch.
    e0 = sorted(digest(r["image"]) for r in run_with_timeout(rows, datasets["train"]))
    e1 = sorted(digest(r["image"]) for r in run_with_timeout(rows, datasets["train"]))
    assert e0 == e1


def test_train_crops_reproducible_given_seed_and_new_each_epoch(ray_local, folder):
    def epochs(seed, n=2):
        ds = build_datasets("imagefolder", folder, SIZE, seed=seed)[0]["train"]
        return [collections.Counter(digest(r["image"]) for r in run_with_timeout(rows, ds))
                for _ in range(n)]

    a, b, c = epochs(1), epochs(1), epochs(2, n=1)
    assert a == b  # same seed: same crops, epoch by epoch
    assert a[0] != a[1]  # a new epoch draws new crops
    assert a[0] != c[0]  # another seed, other crops


def _rows_only(batch):
    return {"row": batch["row"]}


def test_each_epoch_reads_every_listed_image_once_in_its_own_order(ray_local, folder):
    table = list_image_folder(folder).tables["train"]
    n = table.num_rows

    def epochs(shuffle, seed, count=2):
        """Per epoch: the tasks' row groups (tasks finish in any order: sorted)."""
        ds = listing_dataset(table, 7, shuffle, seed, _rows_only)
        return [sorted(tuple(b["row"].tolist()) for b in run_with_timeout(
            lambda: list(ds.iter_batches(batch_size=None)))) for _ in range(count)]

    a, b = epochs(True, 0), epochs(True, 0)
    assert all(sorted(sum(e, ())) == list(range(n)) for e in a)  # every image once an epoch
    assert a == b and a[0] != a[1]  # (seed, epoch) decide the order; a new epoch, a new one
    assert epochs(True, 1, 1)[0] != a[0]
    val = epochs(False, 0, 1)[0]  # val: the listing's order, 7 rows a task
    assert val == [tuple(range(i, min(i + 7, n))) for i in range(0, n, 7)]


def test_rrc_params_match_torchvision_bounds():
    rng = np.random.default_rng(0)
    for w, h in [(40, 30), (500, 20), (13, 13)]:
        for _ in range(50):
            left, top, cw, ch = rrc_params(w, h, rng)
            assert 0 <= left and 0 <= top and left + cw <= w and top + ch <= h and cw and ch


# ---------------------------------------------------------------------------- pack + parquet


def test_pack_round_trip(ray_local, folder, tmp_path):
    import pyarrow.parquet as pq

    from raytrain import pack

    out = str(tmp_path / "packed")
    counts = run_with_timeout(pack.pack, folder, out, 20, 0.001)  # tiny shards: several files
    listing = list_image_folder(folder)
    assert counts == listing.counts
    assert json.load(open(os.path.join(out, "classes.json"))) == listing.class_names
    files = sorted(os.listdir(os.path.join(out, "train")))
    assert len(files) > 1
    table = pq.read_table(os.path.join(out, "train"))
    packed = dict(zip(table.column("path").to_pylist(), table.column("label").to_pylist()))
    src = listing.tables["train"]
    root = folder.rstrip("/") + "/"
    assert packed == {p[len(root):]: y for p, y in zip(src.column("path").to_pylist(),
                                                       src.column("label").to_pylist())}
    datasets, names, n = build_datasets("parquet", out, SIZE)
    assert names == listing.class_names and n == listing.counts
    got = run_with_timeout(rows, datasets["val"])
    assert len(got) == 7 and sorted(int(r["label"]) for r in got) == \
        sorted(listing.tables["val"].column("label").to_pylist())
    assert got[0]["image"].shape == (3, SIZE, SIZE)


def test_parquet_hf_struct_column_and_missing_columns(ray_local, tmp_path, folder):
    import pyarrow as pa
    import pyarrow.parquet as pq

    listing = list_image_folder(folder)
    for split in ("train", "val"):
        t = listing.tables[split]
        data = [open(p, "rb").read() for p in t.column("path").to_pylist()]
        image = pa.array([{"bytes": d, "path": None} for d in data],
                         pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
        os.makedirs(tmp_path / "hf" / split)
        pq.write_table(pa.table({"image": image, "label": t.column("label")}),
                       tmp_path / "hf" / split / "0.parquet")
        os.makedirs(tmp_path / "bad" / split)
        pq.write_table(pa.table({"img": pa.array(data), "label": t.column("label")}),
                       tmp_path / "bad" / split / "0.parquet")
    for d in ("hf", "bad"):
        (tmp_path / d / "classes.json").write_text(json.dumps(listing.class_names))
    datasets, _, counts = build_datasets("parquet", str(tmp_path / "hf"), SIZE)
    assert len(run_with_timeout(rows, datasets["train"])) == counts["train"] == 18
    with pytest.raises(ConfigError, match="--data-dir.*columns image"):
        build_datasets("parquet", str(tmp_path / "bad"), SIZE)


# ---------------------------------------------------------------------------- ranks


def consume_ranks(iterators, per_rank_fn):
    """Run one consumer thread per simulated rank (streaming_split needs them concurrent)."""
    out = [None] * len(iterators)

    def work(i):
        out[i] = per_rank_fn(iterators[i])

    threads = [threading.Thread(target=work, args=(i,), daemon=True)
               for i in range(len(iterators))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive(), "a rank hung"
    return out


def test_two_ranks_get_equal_train_step_counts(ray_local, folder):
    datasets, _, counts = build_datasets("imagefolder", folder, SIZE, seed=3)
    splits = data_config().configure(datasets, world_size=2, worker_handles=None,
                                               worker_node_ids=None)
    train_its = [s["train"] for s in splits]
    expected = steps_per_epoch(counts["train"], 2, 4)

    def two_epochs(it):
        return [sum(1 for _ in iter_batches(it, 4, "cpu", train=True))
                for _ in range(2)]

    steps = consume_ranks(train_its, two_epochs)
    assert steps == [[expected] * 2] * 2, steps


@pytest.mark.parametrize("world", [2, 3])
def test_eval_split_covers_every_val_image_once(ray_local, folder, world):
    datasets, _, counts = build_datasets("imagefolder", folder, SIZE,
                                                   decode_on_worker=True)
    assert counts["val"] % world  # 7 images: no world size here divides it
    splits = data_config().configure(datasets, world_size=world,
                                               worker_handles=None, worker_node_ids=None)

    def keys(it):
        return [int(k) for b in it.iter_batches(batch_size=2) for k in b["key"]]

    per_rank = consume_ranks([s["val"] for s in splits], keys)
    seen = sorted(k for ks in per_rank for k in ks)
    assert seen == list(range(counts["val"])), per_rank


def test_worker_side_decode_matches_task_decode(ray_local, folder):
    task = build_datasets("imagefolder", folder, SIZE, augment=False)[0]["val"]
    worker = build_datasets("imagefolder", folder, SIZE, augment=False,
                                      decode_on_worker=True)[0]["val"]
    spec = {"size": SIZE, "train": False, "seed": 0}
    xs, ys, _ = zip(*run_with_timeout(lambda: list(iter_batches(
        worker.iterator(), 3, "cpu", train=False, decode=spec))))
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.dtype == torch.uint8 and x.shape == (7, 3, SIZE, SIZE) and y.dtype == torch.int64
    ref = run_with_timeout(rows, task)
    assert sorted(y.tolist()) == sorted(int(r["label"]) for r in ref)
    # Same boxes, other resampler (antialiased tensor resize vs PIL's): close, not identical.
    ref_mean = np.mean([r["image"].astype(float).mean() for r in ref])
    assert abs(float(x.float().mean()) - ref_mean) < 10


def test_check_data_cpus():
    assert check_data_cpus(2, 2, 0.5, data_cpus=1) == 1
    with pytest.raises(ConfigError) as err:
        check_data_cpus(2, 2, 1, data_cpus=1)
    assert "\n" not in str(err.value) and "--data-cpus" in str(err.value)
    with pytest.raises(ConfigError):
        check_data_cpus(8, 2, 1, data_cpus=1, concurrent_runs=4)


# ---------------------------------------------------------------------------- S3


def test_s3_listing_and_reading(ray_local, folder, s3_server):
    upload_folder(folder, "images", "data")
    listing = list_image_folder("s3://images/data")
    local = list_image_folder(folder)
    assert listing.class_names == local.class_names and listing.counts == local.counts
    assert listing.tables["train"].column("label").to_pylist() == \
        local.tables["train"].column("label").to_pylist()
    datasets, names, counts = build_datasets("imagefolder", "s3://images/data", SIZE)
    got = run_with_timeout(rows, datasets["val"])
    assert len(got) == counts["val"] == 7 and got[0]["image"].shape == (3, SIZE, SIZE)
    with pytest.raises(ConfigError, match="--data-dir"):
        list_image_folder("s3://images/nothing-here")


# ---------------------------------------------------------------------------- real Train run


def _probe_loop(config):
    """Per-worker loop: two training epochs of batches, then one evaluation pass."""
    import ray.train
    import torch.distributed as dist

    rank = ray.train.get_context().get_world_rank()
    train_it = ray.train.get_dataset_shard("train")
    val_it = ray.train.get_dataset_shard("val")
    steps = [sum(1 for _ in iter_batches(train_it, 4, "cpu", train=True))
             for _ in range(2)]
    seen = torch.tensor([sum(len(y) for _, y, _ in
                             iter_batches(val_it, 4, "cpu", train=False))])
    dist.all_reduce(seen)  # once, after the pass: ranks' val counts differ
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"steps": steps, "val_seen": int(seen)}, f)


def test_torchtrainer_two_workers_equal_steps_exact_eval(ray_local, folder, tmp_path):
    """A real TorchTrainer (Train V2): 2 workers x 0.5 CPU leave 1 CPU for Ray Data."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    datasets, _, counts = build_datasets("imagefolder", folder, SIZE, seed=0)
    assert check_data_cpus(2, 2, 0.5, data_cpus=1) == 1
    reserve_data_cpus(1)  # before the trainer copies the DataContext
    try:
        trainer = TorchTrainer(
            _probe_loop, train_loop_config={"out": str(tmp_path)},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            datasets=datasets, dataset_config=data_config(),
            run_config=RunConfig(name="probe", storage_path=str(tmp_path / "runs")))
        run_with_timeout(trainer.fit, timeout=240)
    finally:
        reserve_data_cpus(None)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    expected = steps_per_epoch(counts["train"], 2, 4)
    assert [r["steps"] for r in ranks] == [[expected] * 2] * 2
    assert [r["val_seen"] for r in ranks] == [counts["val"]] * 2
