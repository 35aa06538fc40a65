"""``python -m raytrain.predict`` (issue 30): a run trained 2 epochs on the digits image folder
labels its val images copied without their class folders, on the session's 2-CPU Ray cluster;
bucket input and output on the moto server; Parquet input; bad inputs; bounded memory.

    python -m pytest -q tests/test_predict.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch

from raytrain import evaluate, predict
from tests.helpers import fit_in_process, read_only_dir, upload_folder, wait_until
from tests.test_own_data import N_VAL, write_digits_folder


def _predict(*argv: str) -> tuple[int, str, str]:
    """``raytrain.predict.main`` in this process: rc, stdout, stderr (also printed)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = predict.main(list(argv))
    print(out.getvalue(), err.getvalue())
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    return write_digits_folder(tmp_path_factory.mktemp("digits-folder"))


@pytest.fixture(scope="module")
def run_dir(ray_cluster, digits_folder, tmp_path_factory):
    """A run trained 2 epochs on the digits folder (config.yaml, classes.json, model.pt)."""
    runs = tmp_path_factory.mktemp("runs")
    rc, _, err = fit_in_process("--dataset", "imagefolder", "--data-dir", digits_folder,
                                "--image-size", "32", "--num-workers", "1", "--epochs", "2",
                                "--storage-path", str(runs), "--name", "digits")
    assert rc == 0, err
    return runs / "digits"


@pytest.fixture(scope="module")
def flat_folder(digits_folder, tmp_path_factory):
    """The val images with no class folders: most flat, some nested under unrelated folders;
    plus a corrupt JPEG, a truncated one and a stray text file. Returns (folder, true class
    name of each image path relative to it)."""
    root = tmp_path_factory.mktemp("flat")
    truth = {}
    val = os.path.join(digits_folder, "val")
    for cls in sorted(os.listdir(val)):
        if not os.path.isdir(os.path.join(val, cls)):
            continue
        for i, name in enumerate(sorted(os.listdir(os.path.join(val, cls)))):
            rel = f"{cls}-{name}" if i % 3 else os.path.join("batch", f"x{i % 2}", f"{cls}-{name}")
            os.makedirs(os.path.dirname(root / rel), exist_ok=True)
            shutil.copy(os.path.join(val, cls, name), root / rel)
            truth[rel] = cls
    assert len(truth) == N_VAL
    jpeg = next(r for r in sorted(truth) if r.endswith(".jpg"))
    data = (root / jpeg).read_bytes()
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    (root / "batch" / "truncated.JPG").write_bytes(data[:len(data) // 2])
    (root / "notes.txt").write_text("not an image")
    return str(root), truth


@pytest.fixture(scope="module")
def flat_preds(ray_cluster, run_dir, flat_folder, tmp_path_factory):
    """(rows as a pyarrow table, stdout) of one prediction over the flat folder."""
    out = tmp_path_factory.mktemp("preds") / "preds.parquet"
    rc, said, err = _predict(str(run_dir), "--data-dir", flat_folder[0], "--out", str(out),
                             "--top-k", "3", "--batch-size", "100", "--progress-every", "0.2")
    assert rc == 0, err
    assert os.listdir(out.parent) == ["preds.parquet"]  # no temporary file left beside it
    return pq.read_table(out), said


def _correct(rows: list[dict], truth: dict[str, str], root: str) -> int:
    return sum(r["class"] == truth[os.path.relpath(r["path"], root)] for r in rows
               if not r["error"])


def test_labels_every_image_once_with_the_runs_classes_and_evaluates_score(
        flat_preds, flat_folder, run_dir, digits_folder):
    table, said = flat_preds
    root, truth = flat_folder
    rows = table.to_pylist()
    assert table.column_names == ["path", "class", "label", "prob", "topk_class", "topk_prob",
                                  "error"]
    rel = sorted(os.path.relpath(r["path"], root) for r in rows)
    assert rel == sorted([*truth, "broken.jpg", os.path.join("batch", "truncated.JPG")])
    bad = {os.path.basename(r["path"]): r for r in rows if r["error"]}
    assert sorted(bad) == ["broken.jpg", "truncated.JPG"], bad
    assert all(r["class"] is None and r["label"] is None for r in bad.values())
    names = json.loads((run_dir / "classes.json").read_text())
    good = [r for r in rows if not r["error"]]
    for r in good:
        assert r["class"] == names[r["label"]] and r["topk_class"][0] == r["class"]
        assert r["topk_prob"][0] == pytest.approx(r["prob"])
        assert r["topk_prob"] == sorted(r["topk_prob"], reverse=True)
        assert sum(r["topk_prob"]) <= 1.0001
    # The accuracy the rows imply is evaluate's on the same images (the run's val split)
    result = evaluate.evaluate_path(str(run_dir), "seed-cnn", "imagefolder", digits_folder,
                                    image_size=32)
    assert result["test_count"] == N_VAL
    assert _correct(good, truth, root) == round(result["test_acc"] * N_VAL)
    assert result["test_acc"] > 0.3  # learned something (chance is 0.1)
    assert f"predicted {N_VAL + 2} images (2 could not be read)" in said
    assert f"/{N_VAL + 2:,} images" in said and "images/s  ETA" in said  # a progress line


def test_bucket_model_input_and_output(s3_server, ray_cluster, run_dir, flat_folder, flat_preds):
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from raytrain import storage

    root, truth = flat_folder
    images = upload_folder(root, "predict-in", "new")
    model = upload_folder(run_dir, "predict-runs", "runs/digits")  # model.pt, config, classes
    out = "s3://predict-in/out/preds.csv"
    rc, _, err = _predict(model, "--data-dir", images, "--out", out)
    assert rc == 0, err
    strings = pcsv.ConvertOptions(column_types={"class": pa.string()})
    rows = pcsv.read_csv(io.BytesIO(storage.read_bytes(out)), convert_options=strings
                         ).to_pylist()
    assert len(rows) == N_VAL + 2 and "topk_class" not in rows[0]
    prefix = "s3://predict-in/new/"
    local = {os.path.relpath(r["path"], root): r["class"] for r in flat_preds[0].to_pylist()}
    remote = {r["path"].removeprefix(prefix): r["class"] or None for r in rows}  # null: ""
    assert remote == local  # same weights, same images, same rows


def test_checkpoint_directory_as_model(ray_cluster, run_dir, flat_folder, tmp_path):
    """A checkpoint directory: its state.pt, the run's config.yaml and classes.json above it."""
    (ckpt,) = sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint_")
                     and os.path.isdir(run_dir / d))[-1:]
    some = tmp_path / "some"
    os.makedirs(some)
    for rel in sorted(flat_folder[1])[:20]:
        shutil.copy(os.path.join(flat_folder[0], rel), some / os.path.basename(rel))
    out = tmp_path / "p.csv"
    rc, _, err = _predict(str(run_dir / ckpt), "--data-dir", str(some), "--out", str(out))
    assert rc == 0, err
    import csv

    with open(out) as f:
        rows = list(csv.DictReader(f))
    names = json.loads((run_dir / "classes.json").read_text())
    assert len(rows) == 20 and all(r["class"] in names and not r["error"] for r in rows)


def test_parquet_input_from_pack(ray_cluster, run_dir, digits_folder, tmp_path):
    from raytrain import pack

    shards = str(tmp_path / "shards")
    pack.pack(digits_folder, shards, shard_mb=0.1)
    out = tmp_path / "val.parquet"
    rc, _, err = _predict(str(run_dir), "--data-dir", os.path.join(shards, "val"), "--out",
                          str(out), "--batch-size", "64")
    assert rc == 0, err
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == N_VAL and not any(r["error"] for r in rows)
    # pack's path column: val/<class>/<file>, the true class
    correct = sum(r["class"] == r["path"].split("/")[1] for r in rows)
    result = evaluate.evaluate_path(str(run_dir), "seed-cnn", "imagefolder", digits_folder,
                                    image_size=32)
    assert correct == round(result["test_acc"] * N_VAL)


def test_a_run_that_fails_midway_leaves_no_file_and_the_old_one_whole(tmp_path):
    import pyarrow as pa

    from raytrain.infer.output import Output

    rows = pa.table({"path": ["a.jpg"], "class": ["cat"], "label": [0], "prob": [0.9],
                     "error": [""]})
    out = tmp_path / "p.parquet"
    with Output(str(out), top_k=1) as o:
        o.write(rows)
    with pytest.raises(KeyboardInterrupt):
        with Output(str(out), top_k=1) as o:
            o.write(rows)
            o.write(rows)
            raise KeyboardInterrupt  # Ctrl-C between two batches
    assert os.listdir(tmp_path) == ["p.parquet"] and pq.read_table(out).num_rows == 1


# ---------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A bare lenet model.pt (no config beside it) and a folder of 3 images."""
    from PIL import Image

    from raytrain.models import build_model

    root = tmp_path_factory.mktemp("bare")
    torch.save(build_model("lenet", 10).state_dict(), root / "model.pt")
    os.makedirs(root / "imgs")
    for i in range(3):
        Image.new("RGB", (40, 30), (i * 80, 0, 0)).save(root / "imgs" / f"{i}.png")
    (root / "three.json").write_text(json.dumps(["a", "b", "c"]))
    (root / "text.pt").write_text("not a model")
    os.makedirs(root / "empty")
    (root / "empty" / "README.txt").write_text("no images")
    os.makedirs(root / "notarun")
    return root


def _bad(tmp_path, bare, case: str) -> list[str]:
    m, imgs, out = str(bare / "model.pt"), str(bare / "imgs"), str(tmp_path / "p.parquet")
    common = ["--data-dir", imgs, "--out", out]
    return {
        "missing_model": [str(bare / "nope.pt"), "--model", "lenet", *common],
        "not_a_model": [str(bare / "text.pt"), "--model", "lenet", *common],
        "not_a_run_dir": [str(bare / "notarun"), *common],
        "no_model_name": [m, *common],
        "class_count": [m, "--model", "lenet", "--classes", str(bare / "three.json"), *common],
        "weights_misfit": [m, "--model", "seed-cnn", *common],
        "no_images": [m, "--model", "lenet", "--data-dir", str(bare / "empty"), "--out", out],
        "missing_data_dir": [m, "--model", "lenet", "--data-dir", str(bare / "nope"), "--out",
                             out],
        "bad_extension": [m, "--model", "lenet", "--data-dir", imgs, "--out",
                          str(tmp_path / "p.json")],
        "no_cpu_left": [m, "--model", "lenet", *common, "--num-workers", "2",
                        "--cpus-per-worker", "1"],
        "no_gpu": [m, "--model", "lenet", *common, "--use-gpu"],
    }[case]


@pytest.mark.parametrize("case,says", [
    ("missing_model", "no such file"), ("not_a_model", "cannot load checkpoint"),
    ("not_a_run_dir", "not a run or checkpoint directory"), ("no_model_name", "--model"),
    ("class_count", "--classes"), ("weights_misfit", "do not fit --model seed-cnn"),
    ("no_images", "--data-dir"), ("missing_data_dir", "--data-dir"),
    ("bad_extension", "--out"), ("no_cpu_left", "--data-cpus"), ("no_gpu", "--num-workers")])
def test_bad_input_is_one_line_exit_2_within_seconds(tmp_path, bare, case, says):
    import ray

    if case == "no_gpu" and torch.cuda.device_count():
        pytest.skip("this machine has a GPU")
    started = ray.is_initialized()
    t0 = time.monotonic()
    rc, _, err = _predict(*_bad(tmp_path, bare, case))
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 20
    assert ray.is_initialized() == started  # refused before a cluster starts
    assert not os.path.exists(tmp_path / "p.parquet")


def test_unwritable_output_is_one_line(tmp_path, bare):
    with read_only_dir(tmp_path / "ro") as ro:
        rc, _, err = _predict(str(bare / "model.pt"), "--model", "lenet", "--data-dir",
                              str(bare / "imgs"), "--out", os.path.join(ro, "p.csv"))
    assert rc == 2 and "--out" in err and len(err.strip().splitlines()) == 1, err


def test_layout_with_no_cpu_left_on_the_connected_cluster(ray_cluster, tmp_path, bare):
    t0 = time.monotonic()
    rc, _, err = _predict(*_bad(tmp_path, bare, "no_cpu_left"))
    assert rc == 2 and "--data-cpus" in err and "2-CPU cluster" in err, err
    assert time.monotonic() - t0 < 20


def test_workers_that_cannot_start_fail_after_wait_timeout_not_hang(ray_cluster, tmp_path,
                                                                   bare):
    """The cluster's CPUs held by another job (a real placement group): the layout fits the
    cluster's totals, but no actor can start. One line after --wait-timeout, no file."""
    import ray
    from ray.util import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready(), timeout=30)
    try:
        t0 = time.monotonic()
        rc, _, err = _predict(str(bare / "model.pt"), "--model", "lenet", "--data-dir",
                              str(bare / "imgs"), "--out", str(tmp_path / "p.csv"),
                              "--wait-timeout", "3")
        took = time.monotonic() - t0
    finally:
        remove_placement_group(pg)
    assert rc == 1 and "--wait-timeout 3s: no room" in err, err
    assert len(err.strip().splitlines()) == 1 and took < 30, (took, err)
    assert not os.listdir(tmp_path)
    # The actor whose start timed out does not start (and hold a CPU) once the CPUs are free
    wait_until(lambda: ray.available_resources().get("CPU") == 2, 15, "the CPUs all free")
    time.sleep(3)
    assert ray.available_resources().get("CPU") == 2


# ---------------------------------------------------------------------------- memory


MEMORY_RUN = """
import sys, threading, time
import psutil, ray
# An object store of 80 MiB (Ray's minimum is 75): the decoded images are 1.46x that.
ray.init(address="local", num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
         logging_level="ERROR")
import torch, torchvision, ray.data, pyarrow.parquet  # imported before the baseline
from raytrain import predict
from raytrain.infer import inputs, model, output, pipeline, run
me, peak, done = psutil.Process(), [0], []
def private():  # the object store's shared pages the driver maps are not its own memory
    m = me.memory_info()
    return m.rss - m.shared
def sample():
    while not done:
        peak[0] = max(peak[0], private())
        time.sleep(0.02)
base = private()
threading.Thread(target=sample, daemon=True).start()
try:
    rc = predict.main(sys.argv[1:])
finally:
    done.append(1)
    ray.shutdown()
print("DRIVER_GROWTH_MB", (peak[0] - base) / 2**20)
sys.exit(rc)
"""


def test_predicts_more_decoded_images_than_the_object_store_holds(tmp_path):
    """40,000 digit JPEGs as Parquet rows: 117 MiB decoded at 32x32 through an 80 MiB object
    store, on a Ray cluster of its own; the driver streams the rows to the file (measured
    on 60,000: its own memory grew 31 MiB, the imports excluded)."""
    import pyarrow as pa
    from PIL import Image

    from raytrain.data import load_dataset
    from raytrain.models import build_model

    data = load_dataset("digits")
    encoded = []
    for x in data.train_x.permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(x).save(buf, format="JPEG", quality=90)
        encoded.append(buf.getvalue())
    n, files = 40_000, 5
    os.makedirs(tmp_path / "big")
    for f in range(files):
        idx = [(f * n // files + i) % len(encoded) for i in range(n // files)]
        pq.write_table(pa.table({"image": [encoded[i] for i in idx],
                                 "path": [f"img{f}-{i}.jpg" for i in range(len(idx))]}),
                       tmp_path / "big" / f"{f}.parquet")
    assert n * 3 * 32 * 32 > 1.4 * 80 * 2**20  # decoded: 1.46x the object store
    torch.save(build_model("lenet", 10).state_dict(), tmp_path / "lenet.pt")
    out = tmp_path / "big.parquet"
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_RUN, str(tmp_path / "lenet.pt"), "--model", "lenet",
         "--data-dir", str(tmp_path / "big"), "--out", str(out), "--batch-size", "512"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pq.read_table(out, columns=["path", "error"])
    assert table.num_rows == n and len(set(table.column("path").to_pylist())) == n
    assert table.column("error").to_pylist().count("") == n
    growth = float(proc.stdout.split("DRIVER_GROWTH_MB")[1].split()[0])
    print(proc.stdout[-500:])
    # The driver held rows (~40 bytes each), never the pixels (117 MiB): it would grow by that
    assert growth < 58, growth


def test_decode_tasks_are_not_fused_into_the_inference_actors(ray_cluster, bare):
    """Ray 2.60 fuses a task map into the next actor map when their resources are equal: the
    images were then decoded inside the actors, the CPUs left for decoding idle."""
    from raytrain.infer import inputs, model, pipeline

    spec, weights = model.resolve(str(bare / "model.pt"), model="lenet")
    found = inputs.list_inputs(str(bare / "imgs"))
    plan = pipeline.size_layout(2, 0, num_workers=1, use_gpu=False)
    ds = pipeline.build_dataset(spec, weights, found, plan, batch_size=2, top_k=1)
    rows = [r for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow")
            for r in batch.to_pylist()]
    assert len(rows) == 3 and all(r["class"] in [str(i) for i in range(10)] for r in rows)
    stats = ds.stats()
    assert "MapBatches(Predictor)" in stats and "->MapBatches(Predictor)" not in stats, stats
