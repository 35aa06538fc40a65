"""Data: sharding, evaluation coverage, batching, augmentation and the dataset loaders."""

from __future__ import annotations

import os

import pytest
import torch

from raytrain.config import ConfigError
from raytrain.data import (Augment, batches, crop_and_flip, epoch_shard, eval_shard,
                           load_dataset, steps_per_epoch)
from tests.helpers import write_tiny_cifar


@pytest.mark.parametrize("n,world", [(10, 1), (10, 3), (1437, 2), (1437, 4), (7, 8)])
def test_shards_cover_every_sample_exactly_once_per_epoch(n, world):
    for epoch in (1, 2):
        shards = [epoch_shard(n, r, world, seed=0, epoch=epoch) for r in range(world)]
        merged = torch.cat(shards)
        assert sorted(merged.tolist()) == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shards_reshuffle_every_epoch_and_agree_across_workers():
    a = epoch_shard(1000, 0, 2, seed=0, epoch=1)
    assert torch.equal(a, epoch_shard(1000, 0, 2, seed=0, epoch=1))
    assert not torch.equal(a, epoch_shard(1000, 0, 2, seed=0, epoch=2))
    assert not torch.equal(a, epoch_shard(1000, 0, 2, seed=1, epoch=1))


@pytest.mark.parametrize("n,world", [(360, 2), (361, 3), (5, 8)])
def test_eval_shards_count_every_test_sample_once(n, world):
    merged = torch.cat([eval_shard(n, r, world) for r in range(world)])
    assert merged.tolist() == list(range(n))


@pytest.mark.parametrize("n,world,b", [(1437, 2, 64), (100, 3, 7), (10, 3, 2), (9, 2, 4)])
def test_every_worker_takes_the_same_number_of_nonempty_steps(n, world, b):
    steps = steps_per_epoch(n, world, b)
    for r in range(world):
        parts = batches(epoch_shard(n, r, world, 0, 1), steps)
        assert len(parts) == steps
        assert all(0 < len(p) <= b for p in parts)


def test_crop_and_flip_takes_padded_windows_and_mirrors_about_half():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 255, (64, 3, 8, 8), dtype=torch.uint8)
    out = crop_and_flip(x, 2, True, g)
    assert out.shape == x.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    mirrored = 0
    for i in range(64):  # each output is a window of the padded image, maybe mirrored
        windows = [padded[i, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
        plain = any(torch.equal(out[i], win) for win in windows)
        flipped = any(torch.equal(out[i], win.flip(2)) for win in windows)
        assert plain or flipped
        mirrored += flipped and not plain
    assert 10 < mirrored < 54


def test_augment_normalises_and_is_deterministic_per_generator():
    aug = Augment((0.5,) * 3, (0.25,) * 3, torch.device("cpu"), crop_pad=4, flip=True)
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    plain = Augment((0.5,) * 3, (0.25,) * 3, torch.device("cpu"))(x)
    assert torch.allclose(plain, (x.float() / 255 - 0.5) / 0.25, atol=1e-5)
    a = aug(x, torch.Generator().manual_seed(3))
    assert torch.equal(a, aug(x, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, aug(x, torch.Generator().manual_seed(4)))


def test_digits_split_is_fixed_stratified_80_20():
    d = load_dataset("digits")
    assert len(d.train_y) == 1437 and len(d.test_y) == 360
    assert d.train_x.dtype == torch.uint8 and tuple(d.train_x.shape[1:]) == (3, 32, 32)
    assert torch.equal(d.test_y, load_dataset("digits").test_y)
    counts = torch.bincount(d.test_y, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # stratified: ~36 of each digit


def test_cifar10_loader_reads_the_on_disk_format(tmp_path):
    write_tiny_cifar(tmp_path, n_per_batch=20, n_test=40)
    d = load_dataset("cifar10", str(tmp_path))
    assert d.train_x.shape == (100, 3, 32, 32) and d.test_x.shape == (40, 3, 32, 32)
    assert d.train_x.dtype == torch.uint8 and d.num_classes == 10 and d.flip_ok


def test_cifar10_corrupt_copy_names_the_data_dir(tmp_path):
    folder = write_tiny_cifar(tmp_path)
    path = os.path.join(folder, "data_batch_3")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match="--data-dir"):
        load_dataset("cifar10", str(tmp_path))


def test_digits_are_kept_as_tensors_and_read_back_without_scikit_learn():
    """A worker's way to its first step: the second load of digits reads the kept tensors
    (no scikit-learn import, 1.5-2.6 s on 2 cores), and they are the very split it made."""
    import subprocess
    import sys

    from raytrain.data.builtin import _load_digits, _make_digits

    made, loaded = _make_digits(), _load_digits()  # the second makes the file if missing
    for key in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(made, key), getattr(loaded, key))
    assert (made.mean, made.std, made.num_classes) == (loaded.mean, loaded.std, 10)
    probe = ("import sys; from raytrain.data.builtin import load_dataset; "
             "d = load_dataset('digits'); print(len(d.train_y), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(len(made.train_y)), "False"]
