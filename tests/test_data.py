"""Data: sharding, evaluation coverage, batching, augmentation and the dataset loaders."""

from __future__ import annotations

import os

import pytest
import torch

from raytrain.config import ConfigError
from raytrain.data import (Augment, batches, epoch_shard, eval_shard, load_dataset,
                           random_crop, steps_per_epoch)
from tests.conftest import write_tiny_cifar


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


def test_random_crop_is_a_shifted_window_and_flip_mirrors():
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).view(2, 1, 4, 4) + 1
    g = torch.Generator().manual_seed(0)
    out = random_crop(x, 1, g)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1))
    for i in range(2):  # each output is some 4x4 window of the padded image
        assert any(torch.equal(out[i, 0], padded[i, 0, dy:dy + 4, dx:dx + 4])
                   for dy in range(3) for dx in range(3))
    aug = Augment((0.0,), (1 / 255,), torch.device("cpu"), flip=True)
    img = torch.randint(0, 255, (64, 1, 4, 4), dtype=torch.uint8)
    flipped = aug(img, torch.Generator().manual_seed(1))
    same = [torch.equal(flipped[i], img[i].float()) for i in range(64)]
    mirrored = [torch.equal(flipped[i], img[i].float().flip(2)) for i in range(64)]
    assert all(s or m for s, m in zip(same, mirrored)) and 10 < sum(mirrored) < 54


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
