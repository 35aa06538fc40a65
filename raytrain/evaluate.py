"""``python -m raytrain.evaluate PATH --dataset digits``: test loss/accuracy of saved weights.

PATH is a run directory (uses its model.pt), a checkpoint directory, a checkpoint state.pt or
an exported model.pt, on a local path or in a bucket (``s3://…``, ``gs://…``: what it needs is
downloaded to a temporary directory first). Files are read with
``torch.load(weights_only=True)``: a file that holds anything but tensors and plain containers
is refused and none of its code runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from typing import Iterator

import torch

from raytrain.config import DATASETS, STREAMING
from raytrain.errors import ConfigError, RaytrainError


def evaluate_path(path: str, model_name: str, dataset: str, data_dir: str | None = None,
                  stem: str = "auto", normalize: str = "dataset", image_size: int | None = None,
                  weights: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    from raytrain import checkpoint
    from raytrain.data import Augment, InMemory, load_dataset
    from raytrain.worker.loop import Worker, evaluate
    from raytrain.models import build_model, load_weights

    path = weights_file(path)
    weights = weights if weights is not None else checkpoint.model_weights(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dataset in STREAMING:  # the val split, decoded here (no Ray), as in training
        from raytrain.data.sources import LocalVal

        if not data_dir:
            raise ConfigError("data_dir", data_dir, f"the directory or URI of the {dataset} "
                              "dataset")
        image_size = image_size or 224
        data = LocalVal(dataset, data_dir, image_size)
    else:
        image_size = 32
        data = InMemory(load_dataset(dataset, data_dir).to(device))
    model = build_model(model_name, data.num_classes, stem=stem, image_size=image_size)
    load_weights(model, weights, f"{path}: weights do not fit --model {model_name} on {dataset}")
    model.to(device)
    aug = Augment(*data.normalization(normalize), device)
    result = evaluate(model, data, aug, None, Worker(0, 0, 1, device), 256)
    loss, correct, n, bad = result["sums"]
    if bad:
        print(f"raytrain: warning: {int(bad)} val image(s) could not be decoded and were left "
              f"out, e.g. {result['bad_image']}", file=sys.stderr)
    return {"test_loss": loss / n, "test_acc": correct / n, "test_count": int(n)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raytrain-evaluate", description=__doc__.splitlines()[0])
    p.add_argument("path", help="run dir, checkpoint dir, state.pt or model.pt")
    p.add_argument("--dataset", default=None, help=f"one of {', '.join(DATASETS)} "
                   "(default: the run's, from its config.yaml)")
    p.add_argument("--model", default=None, help="model name (default: the run's)")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    try:
        with local_copy(args.path) as path:
            return _evaluate(args, path)
    except RaytrainError as err:
        print(f"raytrain: error: {err}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """``path`` itself, or for a bucket URI a local copy of what evaluating it reads."""
    from raytrain import storage

    if not storage.is_uri(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="raytrain-eval-") as tmp:
        try:
            if not storage.exists(path):
                raise RaytrainError(f"{path}: no such file or directory")
            yield storage.fetch_tree(path, tmp)
        except OSError as err:
            raise RaytrainError(f"{path}: cannot read it ({storage.first_line(err)})") from None


def _evaluate(args: argparse.Namespace, path: str) -> int:
    try:
        weights, saved = read(path)
        dataset = args.dataset or saved.get("dataset")
        model = args.model or saved.get("model", "seed-cnn")
        if dataset is None:
            raise RaytrainError(f"{args.path}: no config.yaml beside it and a plain state_dict "
                                "carries no config: pass --dataset (one of "
                                f"{', '.join(DATASETS)}) and --model")
        if dataset not in DATASETS:
            raise ConfigError("dataset", dataset, "one of " + ", ".join(DATASETS))
        result = evaluate_path(path, model, dataset, args.data_dir or saved.get("data_dir"),
                               saved.get("stem", "auto"), saved.get("normalize", "dataset"),
                               saved.get("image_size"), weights=weights)
    except RaytrainError as err:
        print(f"raytrain: error: {err}", file=sys.stderr)
        return 2
    print(f"test_loss {result['test_loss']:.4f}  test_acc {result['test_acc']:.4f}  "
          f"({result['test_count']} images, {dataset}, {model})")
    return 0


def weights_file(path: str) -> str:
    """The file or checkpoint directory ``path`` names: a run directory means its model.pt."""
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "model.pt")):
        return os.path.join(path, "model.pt")
    return path


def read(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(the model weights at ``path``, the run's config): the config.yaml of the run it belongs
    to, else the config a training checkpoint carries, else {} (a model.pt moved on its own).
    Each thing that can be wrong with ``path`` is its own one line."""
    from raytrain import checkpoint

    if not os.path.exists(path):
        raise RaytrainError(f"{path}: no such file or directory")
    target = weights_file(path)
    if os.path.isdir(target) and not os.path.exists(os.path.join(target, checkpoint.STATE_FILE)):
        raise RaytrainError(f"{path}: not a run or checkpoint directory (no model.pt or "
                            f"{checkpoint.STATE_FILE} in it)")
    state = checkpoint.load_file(target)
    weights = checkpoint.model_weights_of(state, target)
    saved = _run_config(path)
    if not saved and isinstance(state, dict) and state.get("format") == checkpoint.FORMAT:
        saved = state.get("config") or {}
    return weights, saved


def _run_config(path: str) -> dict:
    """The config.yaml of the run that ``path`` belongs to, if there is one."""
    import yaml

    for d in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        candidate = os.path.join(d, "config.yaml")
        if d and os.path.isfile(candidate):
            with open(candidate) as f:
                return yaml.safe_load(f) or {}
    return {}


def main_cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_cli()
