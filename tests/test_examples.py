"""The examples resolve to valid configs (dry run); docs/flags.md lists every flag
(tests/test_docs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torchvision

from raytrain import fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, env=None):
    return subprocess.run(["bash", os.path.join(ROOT, "examples", script), *args, "--dry-run"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": os.path.dirname(sys.executable) + ":"
                               + os.environ["PATH"], **(env or {})})


def test_seed_recipe_makes_the_per_worker_batch_explicit():
    proc = _run("seed_ddp_cnn.sh", env={"NUM_WORKERS": "4"})
    assert proc.returncode == 0, proc.stderr
    assert "batch: 256 global = 64 per worker x 4 workers" in proc.stdout
    assert "lr: 0.001" in proc.stdout and "epochs: 10" in proc.stdout
    assert "normalize: none" in proc.stdout and "model: seed-cnn" in proc.stdout


def test_finetune_recipe_accepts_imagenet_shaped_weights(tmp_path):
    weights = tmp_path / "resnet18_imagenet.pt"
    torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(), weights)
    proc = _run("finetune_resnet18.sh", env={"WEIGHTS": str(weights)})
    assert proc.returncode == 0, proc.stderr
    assert "model: resnet18" in proc.stdout and "stem: imagenet" in proc.stdout
    assert "batch: 128 global = 64 per worker x 2 workers" in proc.stdout  # DataParallel's 128
    assert "normalize: half" in proc.stdout and "lr: 0.001" in proc.stdout
    better = _run("finetune_resnet18_better.sh", env={"WEIGHTS": str(weights)})
    assert better.returncode == 0, better.stderr
    assert "stem: cifar" in better.stdout and "128 per worker" in better.stdout


def test_finetune_recipes_run_without_weights():
    for script in ("finetune_resnet18.sh", "finetune_resnet18_better.sh"):
        proc = _run(script, "--dataset", "digits", env={"WEIGHTS": ""})
        assert proc.returncode == 0, proc.stderr
        assert "pretrained: null" in proc.stdout


def test_digits_yaml_example_resolves():
    cfg = fit.resolve(fit.build_parser().parse_args(
        ["--config", os.path.join(ROOT, "examples", "digits.yaml")]))
    assert cfg.data.dataset == "digits" and cfg.per_worker_batch == 32 and cfg.optim.epochs == 15

