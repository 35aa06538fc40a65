"""The two seed recipes (../shared/seeds/): seed-cnn is the seed's Net layer for layer, the
inputs and the log line are the seed's, and the DDP recipe runs end to end as one command."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
import torchvision
from torch import nn

from raytrain.data import Augment, load_dataset
from raytrain.worker.loop import seed_log_line
from raytrain.models import LeNet, SeedCNN, build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _seed_script():
    """benchmarks/seed_ddp.py: the seed's script, with the seed's own Net."""
    spec = importlib.util.spec_from_file_location(
        "seed_ddp", os.path.join(ROOT, "benchmarks", "seed_ddp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_cnn_is_the_seeds_net_layer_for_layer():
    model = SeedCNN(10)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "conv1.weight": (32, 3, 3, 3), "conv1.bias": (32,),
        "conv2.weight": (64, 32, 3, 3), "conv2.bias": (64,),
        "fc1.weight": (512, 4096), "fc1.bias": (512,),
        "fc2.weight": (10, 512), "fc2.bias": (10,)}
    assert model.fc1.weight.numel() == 2_097_152  # 2.1M parameters in fc1 alone
    assert model.conv1.padding == (1, 1) and model.conv2.padding == (1, 1)
    seed = _seed_script().Net()
    seed.load_state_dict(model.state_dict())  # the same keys and shapes as the seed's Net
    x = torch.rand(5, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (5, 10)
        torch.testing.assert_close(out, seed(x))  # the same function, not just the same shapes
        cl = model.to(memory_format=torch.channels_last)
        torch.testing.assert_close(cl(x.contiguous(memory_format=torch.channels_last)), out)


def test_lenet_is_kept_under_its_own_name():
    model = build_model("lenet", 10)
    assert isinstance(model, LeNet)
    assert tuple(model.conv1.weight.shape) == (6, 3, 5, 5)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_resnet_stem_follows_the_flag_and_keeps_torchvision_keys():
    plain = torchvision.models.resnet18(num_classes=10).state_dict()
    cifar = build_model("resnet18", 10)  # auto: 32 px images get the CIFAR stem
    imagenet = build_model("resnet18", 10, stem="imagenet")
    assert cifar.conv1.stride == (1, 1) and isinstance(cifar.maxpool, nn.Identity)
    assert imagenet.conv1.stride == (2, 2) and isinstance(imagenet.maxpool, nn.MaxPool2d)
    assert build_model("resnet18", 10, image_size=224).conv1.stride == (2, 2)
    for model in (cifar, imagenet):
        assert {k: v.shape for k, v in model.state_dict().items()} == \
            {k: v.shape for k, v in plain.items()}


def test_normalize_none_is_to_tensor_and_half_is_the_seeds_normalize():
    data = load_dataset("synthetic", synthetic_size=8)
    x = data.train_x[:4]
    cpu = torch.device("cpu")
    as_tensor = x.float() / 255  # ToTensor()
    torch.testing.assert_close(Augment(*data.normalization("none"), cpu)(x), as_tensor)
    torch.testing.assert_close(Augment(*data.normalization("half"), cpu)(x),
                               (as_tensor - 0.5) / 0.5)
    mean, std = data.normalization("dataset")
    assert (mean, std) == (data.mean, data.std)


def test_log_line_is_the_seeds_format():
    line = seed_log_line(epoch=3, step=100, batch=64, shard=25000, steps=391, loss=0.1234567)
    # the seed: 'Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'
    assert line == "Train Epoch: 3 [6400/25000 (26%)]\tLoss: 0.123457"


def test_seed_ddp_recipe_runs_offline_on_digits(ray_cluster, tmp_path):
    """examples/seed_ddp_cnn.sh as a user runs it (2 epochs to keep the suite fast)."""
    env = {**os.environ, "NUM_WORKERS": "2",
           "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "seed_ddp_cnn.sh"), "--dataset", "digits",
         "--epochs", "2", "--log-every", "5", "--storage-path", str(tmp_path),
         "--address", ray_cluster.address_info["gcs_address"]],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # 1437 training images: 719 on rank 0 in 12 steps (raytrain splits a shard into equal
    # batches: 60, not 64 x 11 + 15) -> lines at steps 0, 5 and 10
    lines = re.findall(r"^Train Epoch: (\d+) \[(\d+)/(\d+) \((\d+)%\)\]\tLoss: (\d+\.\d{6})$",
                       proc.stdout, re.M)
    assert [(e, n, t, p) for e, n, t, p, _ in lines] == [
        (e, n, "719", p) for e in ("1", "2") for n, p in (("0", "0"), ("300", "42"),
                                                          ("600", "83"))]
    assert re.search(r"^Accuracy of the network on the 360 test images: \d+\.\d\d %$",
                     proc.stdout, re.M)
    with open(tmp_path / "seed-ddp-cnn" / "config.yaml") as f:
        saved = f.read()
    for setting in ("model: seed-cnn", "normalize: none", "augment: false", "lr: 0.001",
                    "weight_decay: 0.0", "lr_schedule: constant", "batch_size: 128"):
        assert setting in saved, setting
