"""Datasets as uint8 tensors, per-epoch sharding, and batched on-device augmentation.

No per-sample Python work and no DataLoader processes: a worker holds its images as one
``uint8 [N, 3, 32, 32]`` tensor on its device and builds each batch with a few tensor ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from raytrain.errors import ConfigError, RaytrainError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".cache", "raytrain", "data")


@dataclass
class Dataset:
    """A whole dataset in memory: images uint8 [N, C, H, W], labels int64 [N]."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip_ok: bool  # horizontal flips keep the label (true for photos, not for digits)

    def normalization(self, how: str = "dataset") -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std) for ``--normalize``: the dataset's own, none (ToTensor's [0, 1]) or
        half (the seeds' Normalize((0.5,)*3, (0.5,)*3): [-1, 1])."""
        channels = len(self.mean)
        if how == "none":
            return (0.0,) * channels, (1.0,) * channels
        if how == "half":
            return (0.5,) * channels, (0.5,) * channels
        return self.mean, self.std

    def to(self, device: torch.device) -> "Dataset":
        move = {k: getattr(self, k).to(device, non_blocking=True)
                for k in ("train_x", "train_y", "test_x", "test_y")}
        return Dataset(**move, num_classes=self.num_classes, mean=self.mean, std=self.std,
                       flip_ok=self.flip_ok)


def load_dataset(name: str, data_dir: str | None = None, synthetic_size: int = 6400) -> Dataset:
    """Load a dataset by name (see ``raytrain.config.DATASETS``)."""
    if name in ("cifar10", "cifar100"):
        return _load_cifar(name, data_dir or DEFAULT_DATA_DIR, explicit_dir=data_dir is not None)
    if name == "digits":
        return _load_digits()
    if name == "synthetic":
        return _synthetic(synthetic_size)
    raise ConfigError("dataset", name, "one of cifar10, cifar100, digits, synthetic")


def _load_digits() -> Dataset:
    """scikit-learn's bundled 8x8 digits, upsampled to 3x32x32; 80/20 stratified split. Kept
    as tensors in DEFAULT_DATA_DIR once made: importing scikit-learn and splitting took
    1.5-2.6 s of each worker's way to its first step on 2 cores (issue #27)."""
    from importlib.metadata import version

    from raytrain import files

    path = os.path.join(DEFAULT_DATA_DIR, f"digits-sklearn-{version('scikit-learn')}.pt")
    try:
        return Dataset(**torch.load(path, weights_only=True))
    except (OSError, RuntimeError, TypeError, KeyError, EOFError):  # absent, or unreadable
        pass
    dataset = _make_digits()
    try:
        os.makedirs(DEFAULT_DATA_DIR, exist_ok=True)
        with files.replacing(path) as tmp:  # two workers may write it at once: either wins
            torch.save(vars(dataset), tmp)
    except OSError:  # a read-only home: made again next time
        pass
    return dataset


def _make_digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0  # [N,1,8,8] in [0,1]
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = (x.clamp(0, 1) * 255).round().to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    y = torch.from_numpy(digits.target).long()
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=0.2,
                                           stratify=digits.target, random_state=0)
    tr, te = torch.from_numpy(idx_train), torch.from_numpy(idx_test)
    mean = (float(x[tr].float().mean() / 255),) * 3
    std = (float(x[tr].float().std() / 255),) * 3
    return Dataset(x[tr], y[tr], x[te], y[te], 10, mean, std, flip_ok=False)


def _synthetic(n_train: int) -> Dataset:
    """CIFAR-shaped random images (fixed seed) for throughput benchmarks."""
    g = torch.Generator().manual_seed(1234)
    n_test = max(n_train // 5, 1)
    x = torch.randint(0, 256, (n_train + n_test, 3, 32, 32), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    return Dataset(x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10,
                   CIFAR_MEAN, CIFAR_STD, flip_ok=True)


def _cifar_class(name: str):
    """torchvision's CIFAR class; file checksums are checked only when downloading."""
    from torchvision.datasets import CIFAR10, CIFAR100

    base = CIFAR10 if name == "cifar10" else CIFAR100

    class Files(base):  # type: ignore[misc, valid-type]
        train_list = [[f, None] for f, _ in base.train_list]
        test_list = [[f, None] for f, _ in base.test_list]
        meta = {**base.meta, "md5": None}

    return base, Files


def _load_cifar(name: str, root: str, explicit_dir: bool) -> Dataset:
    base, files = _cifar_class(name)
    folder = os.path.join(root, base.base_folder)
    if not os.path.isdir(folder):
        _download(base, root, name, explicit_dir)
    try:
        train, test = files(root, train=True), files(root, train=False)
        train_x = torch.from_numpy(train.data).permute(0, 3, 1, 2).contiguous()
        test_x = torch.from_numpy(test.data).permute(0, 3, 1, 2).contiguous()
        train_y, test_y = torch.tensor(train.targets), torch.tensor(test.targets)
        num_classes = len(train.classes)
    except Exception as err:  # truncated pickle, wrong shapes, missing batch file, ...
        raise ConfigError("data_dir", root, f"a readable {name} copy in {folder} "
                          f"(torchvision's format); reading it failed: "
                          f"{type(err).__name__}: {str(err)[:120]}") from None
    if len(train_x) != len(train_y) or len(test_x) != len(test_y) or num_classes < 2:
        raise ConfigError("data_dir", root, f"a consistent {name} copy in {folder}")
    return Dataset(train_x, train_y, test_x, test_y, num_classes, CIFAR_MEAN, CIFAR_STD,
                   flip_ok=True)


def _download(base, root: str, name: str, explicit_dir: bool) -> None:
    """Download once per node: a file lock keeps workers on one machine from racing."""
    from filelock import FileLock

    lock = os.path.join(root, f".{name}.lock")
    try:
        os.makedirs(root, exist_ok=True)
        with FileLock(lock):
            base(root, train=True, download=True)
        _remove(lock)  # empty; a worker still waiting on it has it open and goes on
    except Exception as err:
        _remove(lock)
        hint = f"--data-dir {root} holds no {base.base_folder}/" if explicit_dir else \
            f"no copy in {root}"
        raise RaytrainError(f"--dataset {name}: {hint} and the download failed "
                            f"({type(err).__name__}); put an extracted {base.base_folder}/ "
                            f"under a directory and pass it as --data-dir") from None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------- sharding


def epoch_shard(n: int, rank: int, world: int, seed: int, epoch: int) -> torch.Tensor:
    """This worker's sample indices for one epoch, like DistributedSampler.set_epoch(epoch).

    One permutation of all ``n`` indices, seeded by (seed, epoch) so every worker draws the
    same one, dealt out round-robin: the shards are disjoint, cover every index exactly once,
    and differ in size by at most one.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)[rank::world]


def eval_shard(n: int, rank: int, world: int) -> torch.Tensor:
    """Contiguous split of the test set: every test sample is evaluated exactly once."""
    return torch.tensor_split(torch.arange(n), world)[rank]


def steps_per_epoch(n: int, world: int, per_worker_batch: int) -> int:
    """Same on every worker (DDP needs equal step counts): the largest shard's batches."""
    largest_shard = -(-n // world)
    return max(1, -(-largest_shard // per_worker_batch))


def batches(indices: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
    """Split a shard into ``steps`` batches whose sizes differ by at most one."""
    return torch.tensor_split(indices, steps)


class InMemory:
    """A built-in dataset as the worker loop's source of batches (``worker/loop.py``): whole on
    this worker's device, a per-epoch permutation dealt out by rank (``epoch_shard``)."""

    crop_pad = 4  # CIFAR's pad-4 random crop, taken on the device by Augment

    def __init__(self, data: Dataset):
        self.data = data
        self.num_classes, self.flip_ok = data.num_classes, data.flip_ok
        self.n_train, self.n_val = len(data.train_y), len(data.test_y)

    def normalization(self, how: str = "dataset"):
        return self.data.normalization(how)

    def steps(self, world: int, per_worker_batch: int) -> int:
        return steps_per_epoch(self.n_train, world, per_worker_batch)

    def shard_size(self, rank: int, world: int) -> int:
        return len(range(rank, self.n_train, world))

    def train_batches(self, epoch: int, rank: int, world: int, seed: int, steps: int,
                      per_worker_batch: int):
        d = self.data
        shard = epoch_shard(self.n_train, rank, world, seed, epoch).to(d.train_y.device)
        for idx in batches(shard, steps):
            yield d.train_x[idx], d.train_y[idx], []

    def test_batches(self, rank: int, world: int, per_worker_batch: int):
        d = self.data
        for idx in eval_shard(self.n_val, rank, world).to(d.test_y.device).split(EVAL_BATCH):
            yield d.test_x[idx], d.test_y[idx], []


EVAL_BATCH = 1024


# ---------------------------------------------------------------------------- augmentation


class Augment:
    """Batched random crop (black padding, like torchvision's RandomCrop), horizontal flip and
    normalisation on the device: one gather on the uint8 batch, then one fused multiply-add.

    3.2-3.6x faster on one CPU thread than normalise -> pad -> gather -> where-flip
    (benchmarks/augment_variants.py: 28k -> 90k images/s at batch 64).
    """

    def __init__(self, mean, std, device: torch.device, crop_pad: int = 0, flip: bool = False,
                 channels_last: bool = False):
        mean_t = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
        self.inv_std = 1.0 / (torch.tensor(std, device=device).view(1, -1, 1, 1) * 255)
        self.shift = -mean_t * self.inv_std
        self.pad, self.flip, self.channels_last = crop_pad, flip, channels_last

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        """uint8 [B, C, H, W] -> normalised float; random crop/flip when a generator is given."""
        if generator is not None and (self.pad or self.flip):
            x = crop_and_flip(x, self.pad, self.flip, generator)
        x = torch.addcmul(self.shift, x.float(), self.inv_std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def crop_and_flip(x: torch.Tensor, pad: int, flip: bool, generator: torch.Generator
                  ) -> torch.Tensor:
    """Zero-pad by ``pad``, take a random HxW window per image and mirror half of them, as
    one gather over the flattened padded images."""
    b, c, h, w = x.shape
    dev = x.device
    xp = F.pad(x, (pad, pad, pad, pad)) if pad else x
    dy = torch.randint(0, 2 * pad + 1, (b, 1), device=dev, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (b, 1), device=dev, generator=generator)
    cols = torch.arange(w, device=dev).expand(b, w)
    if flip:
        mirror = torch.rand(b, 1, device=dev, generator=generator) < 0.5
        cols = torch.where(mirror, cols.flip(1), cols)
    rows = dy + torch.arange(h, device=dev)
    index = (rows.view(b, h, 1) * (w + 2 * pad) + (dx + cols).view(b, 1, w)).view(b, 1, h * w)
    return xp.reshape(b, c, -1).gather(2, index.expand(b, c, h * w)).view(b, c, h, w)
