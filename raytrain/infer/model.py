"""What a MODEL path stands for: the weights, the network, the class names and the eval
transform (image size, normalisation), checked on the driver before any Ray process starts.

    spec, weights = resolve("runs/my-run")                       # config.yaml + classes.json
    spec, weights = resolve("model.pt", model="resnet18", classes="classes.json")

MODEL is a run directory (its model.pt, config.yaml, classes.json), a checkpoint directory or
its state.pt, or an exported model.pt; local or in a bucket (``evaluate.local_copy``). Files
are read with ``torch.load(weights_only=True)`` (``evaluate.read``), as evaluate does.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from raytrain.errors import ConfigError, RaytrainError

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # data.sources', for own images


@dataclass
class ModelSpec:
    """Everything an inference actor needs besides the weights (small: travels pickled)."""

    model: str
    class_names: list[str]
    image_size: int
    stem: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str  # what MODEL was, for messages

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def to_dict(self) -> dict:
        return asdict(self)


def resolve(path: str, model: str | None = None, classes: str | None = None,
            image_size: int | None = None, stem: str | None = None,
            normalize: str | None = None):
    """(ModelSpec, state_dict) for MODEL ``path``; one-line RaytrainErrors for each way it can be
    wrong (missing, not a model, --model needed, class names that do not fit the weights)."""
    from raytrain import evaluate, storage

    bucket_names = _bucket_classes(path) if storage.is_uri(path) else None
    with evaluate.local_copy(path) as local:
        weights, saved = evaluate.read(local)
        names = _read_classes(classes) if classes else bucket_names or _run_classes(local)
    name = model or saved.get("model")
    if name is None:
        raise ConfigError("model", None, f"the network of the bare weights file {path} (e.g. "
                          "resnet18; a run directory's config.yaml names it itself)")
    from raytrain.model_names import check_model_name

    check_model_name(name)
    size = image_size or saved.get("image_size") or (32 if name in _custom() else 224)
    stem = stem or saved.get("stem", "auto")
    outputs = head_outputs(name, weights, path)
    if names is None:
        names = [str(i) for i in range(outputs)]
    elif len(names) != outputs and classes:
        raise ConfigError("classes", classes, f"{outputs} class names: the weights' head has "
                          f"{outputs} outputs, the class list has {len(names)}")
    elif len(names) != outputs:
        raise RaytrainError(f"{path}: its classes.json has {len(names)} names but the "
                            f"weights' head has {outputs} outputs; pass --classes")
    mean, std = normalization(saved.get("dataset"), normalize or saved.get("normalize",
                                                                            "dataset"))
    spec = ModelSpec(name, list(names), int(size), stem, tuple(mean), tuple(std), path)
    check_loads(spec, weights)
    return spec, weights


def _custom() -> tuple[str, ...]:
    from raytrain.models import CUSTOM

    return tuple(CUSTOM)


def head_outputs(name: str, weights: dict, path: str) -> int:
    """The number of classes the weights' head gives (its last Linear layer's rows)."""
    import torch

    from raytrain.models import build_model, head_keys

    with torch.device("meta"):
        keys = head_keys(build_model(name, 2, image_size=224))
    weight = next((weights[k] for k in sorted(keys) if k.endswith("weight") and k in weights),
                  None)
    if weight is None or weight.dim() != 2:
        raise RaytrainError(f"{path}: weights do not fit --model {name} (no {sorted(keys)[-1]} "
                            "in them)")
    return int(weight.shape[0])


def check_loads(spec: ModelSpec, weights: dict) -> None:
    """Load the weights into the network once here: a mismatch is one line, not N actors'
    tracebacks. Also the network must take the image size."""
    from raytrain.models import build_model, check_input_size, load_weights

    check_input_size(spec.model, spec.num_classes, spec.stem, spec.image_size)
    net = build_model(spec.model, spec.num_classes, stem=spec.stem, image_size=spec.image_size)
    load_weights(net, weights, f"{spec.source}: weights do not fit --model {spec.model}")


def normalization(dataset: str | None, how: str):
    """(mean, std) the run trained with: ImageNet's for own images (and a bare model.pt), the
    built-in dataset's own otherwise; ``none``/``half`` as --normalize says."""
    if how == "none":
        return (0.0,) * 3, (1.0,) * 3
    if how == "half":
        return (0.5,) * 3, (0.5,) * 3
    if dataset in ("cifar10", "cifar100", "digits", "synthetic"):
        from raytrain.data import load_dataset

        data = load_dataset(dataset) if dataset in ("digits", "synthetic") else None
        if data is not None:
            return tuple(data.mean), tuple(data.std)
        from raytrain.data.builtin import CIFAR_MEAN, CIFAR_STD

        return CIFAR_MEAN, CIFAR_STD
    return IMAGENET


def parse_classes(text: str, where: str) -> list[str]:
    from raytrain.data.listing import class_list

    try:
        names = class_list(json.loads(text))
    except ValueError:
        names = None
    if names is None:
        raise ConfigError("classes", where, "a JSON file holding a list of class names in "
                          'label order (["cat", "dog"])')
    return names


def _read_classes(path: str) -> list[str]:
    from raytrain import storage

    try:
        data = storage.read_bytes(path) if storage.is_uri(path) else open(path, "rb").read()
    except OSError as err:
        raise ConfigError("classes", path, f"a readable JSON file ({err.strerror or err})"
                          ) from None
    if data is None:
        raise ConfigError("classes", path, "an existing JSON file of class names")
    return parse_classes(data.decode("utf-8", "replace"), path)


def _run_classes(path: str) -> list[str] | None:
    """classes.json of the run ``path`` belongs to (the directory itself or up to two above:
    run/model.pt, run/checkpoint_x/state.pt), as evaluate finds config.yaml."""
    for d in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        candidate = os.path.join(d, "classes.json")
        if d and os.path.isfile(candidate):
            with open(candidate) as f:
                return parse_classes(f.read(), candidate)
    return None


def _bucket_classes(uri: str) -> list[str] | None:
    """``_run_classes`` for a MODEL in a bucket (its local copy holds only the weights)."""
    import posixpath

    from raytrain import storage

    base = uri.rstrip("/")
    for d in (base, posixpath.dirname(base), posixpath.dirname(posixpath.dirname(base))):
        if "://" not in d or d.endswith(":/"):
            break
        try:
            data = storage.read_bytes(f"{d}/classes.json")
        except OSError:
            data = None
        if data is not None:
            return parse_classes(data.decode("utf-8", "replace"), f"{d}/classes.json")
    return None
