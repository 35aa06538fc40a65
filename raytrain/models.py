"""Model registry. Models know nothing about distribution: no rank, no DDP here.

``seed-cnn`` is the seed DDP script's ``Net``; ``lenet`` LeNet-5. Torchvision ResNets (``resnet18``
...) get a CIFAR stem on small images (``--stem``): conv1 at stride 1 and no max-pool, so 32x32
inputs keep their resolution. conv1 keeps torchvision's 7x7 shape, so the state_dict
is key-for-key and shape-for-shape torchvision's: ``torchvision.models.resnet18(num_classes=10)
.load_state_dict(torch.load("model.pt"))`` accepts it, and ImageNet weights load into it.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from raytrain import files
from raytrain.errors import ConfigError, RaytrainError
from raytrain.model_names import check_model_name


class SeedCNN(nn.Module):
    """The seed DDP script's ``Net``, layer for layer: conv 3->32 3x3 pad 1, ReLU, max-pool 2;
    conv 32->64 3x3 pad 1, ReLU, max-pool 2; fc 64*8*8 -> 512, ReLU; fc 512 -> classes.

    About 7.7M multiply-adds per 32x32 image (2.1M parameters in ``fc1`` alone). The seed's
    ``x.view(-1, 64*8*8)`` is ``torch.flatten(x, 1)`` here: the same values, and it also
    accepts channels_last activations (``view`` would refuse them).
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class LeNet(nn.Module):
    """LeNet-5 (PyTorch's CIFAR-10 tutorial net): conv 3->6 5x5, conv 6->16 5x5, fc
    400->120->84->classes; about 0.65M multiply-adds per image. raytrain's ``seed-cnn`` was
    this network until 2026-12-03; kept as ``lenet``, the fastest model here."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class SmallCNN(nn.Module):
    """A fast BatchNorm CNN for 32x32 inputs (in the spirit of airbench's net, narrower).

    Three conv-pool-conv blocks (widths w, 2w, 4w), global max-pool, linear head;
    about 22M multiply-adds per image at w=32.
    """

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.MaxPool2d(2),
                nn.BatchNorm2d(c_out), nn.GELU(),
                nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out), nn.GELU())

        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.GELU())
        self.blocks = nn.Sequential(block(width, 2 * width), block(2 * width, 4 * width),
                                    block(4 * width, 4 * width))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.amax(x, dim=(2, 3)))


CUSTOM = {"seed-cnn": SeedCNN, "lenet": LeNet, "small-cnn": SmallCNN}  # = model_names.CUSTOM_MODELS


def apply_stem(model: nn.Module, stem: str, image_size: int) -> None:
    """ResNet family: ``cifar`` = conv1 at stride 1 and no max-pool, so small images keep
    their resolution (conv1 keeps its 7x7 shape: the weights stay torchvision's, key for key);
    ``imagenet`` = torchvision's own stem; ``auto`` = cifar for images of 64 px or less."""
    import torchvision

    if not isinstance(model, torchvision.models.ResNet):
        return
    if stem == "cifar" or (stem == "auto" and image_size <= 64):
        model.conv1.stride = (1, 1)
        model.maxpool = nn.Identity()


def load_weights(model: nn.Module, weights: dict, what: str) -> None:
    """``model.load_state_dict(weights)``; a mismatch is one RaytrainError naming ``what``
    (e.g. "PATH: weights do not fit --model NAME") and Torch's first specific line."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        lines = str(err).strip().splitlines()
        raise RaytrainError(f"{what} ({lines[1].strip() if len(lines) > 1 else lines[0]})"
                            ) from None


def build_model(name: str, num_classes: int, pretrained: str | None = None,
                stem: str = "auto", image_size: int = 32) -> nn.Module:
    """A fresh model for ``num_classes``; with ``pretrained``, its weights minus the head."""
    check_model_name(name)
    if name in CUSTOM:
        model = CUSTOM[name](num_classes)
    else:
        import torchvision

        model = torchvision.models.get_model(name, num_classes=num_classes)
        apply_stem(model, stem, image_size)
    if pretrained:
        load_pretrained(model, pretrained)
    return model


def check_input_size(name: str, num_classes: int, stem: str, image_size: int) -> None:
    """A one-line ConfigError when ``name`` cannot take ``image_size`` images (e.g. seed-cnn's
    fc1 is sized for 32x32). A forward on the meta device: shapes only, no memory, no time."""
    with torch.device("meta"):
        model = build_model(name, num_classes, None, stem, image_size)
        try:
            model.eval()(torch.zeros(2, 3, image_size, image_size))
        except (RuntimeError, ValueError) as err:
            raise ConfigError("image_size", image_size, f"a size --model {name} takes "
                              f"({short_error(err)}); seed-cnn and lenet take 32 only, "
                              "torchvision models any size from about 32") from None


def short_error(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__


def head_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the classifier head: the last Linear layer."""
    last = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    return {f"{last}.weight", f"{last}.bias"}


def load_pretrained(model: nn.Module, path: str) -> None:
    """Load a local weights file into ``model``, keeping the model's own (fresh) head."""
    try:
        with warnings.catch_warnings():  # torch's own notes before the refusal: noise
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError("pretrained", path, "a torch weights file (state_dict) loadable "
                          f"with weights_only=True; {files.why_unloadable(path, err)}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a raytrain training checkpoint
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError("pretrained", path, "a state_dict (a dict of tensors)")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = model.state_dict()
    head = head_keys(model)
    mismatched = [k for k, v in state.items()
                  if k in own and k not in head and own[k].shape != v.shape]
    missing = [k for k in own if k not in state and k not in head
               and not k.endswith("num_batches_tracked")]
    if mismatched or missing or not (set(state) & set(own)):
        bad = (mismatched or missing or ["<no matching keys>"])[0]
        raise ConfigError("pretrained", path, f"weights that fit --model (first mismatch: {bad})")
    kept = {k: v for k, v in state.items() if k in own and not
            (k in head and own[k].shape != v.shape)}
    model.load_state_dict(kept, strict=False)
