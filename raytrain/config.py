"""One typed training config, checked once.

Every field of the section dataclasses below is a CLI flag (``lr`` -> ``--lr``) and a YAML key
(``lr: 0.05``, flat or under its section name). The flags are derived from these fields; nothing
lists them twice. ``python -m raytrain.fit --help`` prints them all, one group per dataclass
(``GROUPS``), and ``python tools/flags_md.py`` writes them to docs/flags.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from raytrain.errors import ConfigError, RaytrainError  # noqa: F401 - re-exported
from raytrain.model_names import check_model_name
from raytrain.storage import SCHEMES as STORAGE_SCHEMES, local_dir

BUILTIN = ("cifar10", "cifar100", "digits", "synthetic")
STREAMING = ("imagefolder", "parquet")  # your own images, streamed by Ray Data
DATASETS = BUILTIN + STREAMING
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "digits": 10, "synthetic": 10}  # built-ins
DECODERS = ("tasks", "worker")
OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "cosine", "onecycle")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
NAN_POLICIES = ("stop", "skip")
STEMS = ("auto", "cifar", "imagenet")
NORMALIZATIONS = ("dataset", "none", "half")


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


def parse_num_workers(value: Any) -> int | tuple[int, int]:
    """``4`` -> 4; ``"2:8"`` -> (2, 8) for Ray's elastic mode."""
    accepted = "a whole number >= 1, or MIN:MAX with 1 <= MIN <= MAX"
    if isinstance(value, (list, tuple)) and len(value) == 2:
        value = f"{value[0]}:{value[1]}"
    text = str(value).strip()
    try:
        parts = [int(p) for p in text.split(":")] if not isinstance(value, bool) else []
    except ValueError:
        parts = []
    if len(parts) == 1 and parts[0] >= 1:
        return parts[0]
    if len(parts) == 2 and 1 <= parts[0] <= parts[1]:
        return (parts[0], parts[1]) if parts[0] < parts[1] else parts[0]
    raise ConfigError("num_workers", value, accepted)


@dataclass
class ClusterConfig:
    """Where and on how many workers the job runs."""

    example: ClassVar[str] = ("python -m raytrain.fit --address auto --num-workers 4:8 --use-gpu "
                              "--wait-timeout 900")

    num_workers: Any = _opt(2, "training workers (one DDP replica each); MIN:MAX = elastic",
                            metavar="N|MIN:MAX")
    use_gpu: bool | None = _opt(None, "one GPU per worker (default: if the cluster has GPUs; "
                                "--use-gpu on a cluster without GPUs fails at once)",
                                flags=("--use-gpu", "--no-gpu"))
    cpus_per_worker: float | None = _opt(None, "logical CPUs reserved per worker (default 1; "
                                         "with imagefolder/parquet less where 1 would leave "
                                         "Ray Data no CPU, see --data-cpus)")
    address: str | None = _opt(None, "existing Ray cluster (auto or HOST:PORT); default "
                               "$RAY_ADDRESS, else a new local cluster")
    max_failures: int = _opt(3, "worker-group restarts from the latest checkpoint before failing")
    keep_cluster: bool = _opt(False, "with no --address: start the local cluster with `ray "
                              "start --head` so it and its dashboard outlive the run")
    wait_timeout: float = _opt(60.0, "seconds to wait for room for the workers before "
                               "failing: at the start for an autoscaling cluster (or MIN "
                               "elastic workers) or for CPUs/GPUs other jobs hold, and after "
                               "a node is lost for it to come back or another to join (the "
                               "checkpoints are kept)")

    def __post_init__(self) -> None:
        self.num_workers = parse_num_workers(self.num_workers)
        _check(self.cpus_per_worker is None or self.cpus_per_worker > 0, "cpus_per_worker",
               self.cpus_per_worker, "a number > 0")
        _check(self.max_failures >= 0, "max_failures", self.max_failures, "a whole number >= 0")
        _check(self.wait_timeout > 0, "wait_timeout", self.wait_timeout, "seconds > 0")

    @property
    def worker_cpus(self) -> float:
        """CPUs each worker reserves: --cpus-per-worker, else 1 (preflight may set less for
        streamed data, see driver/preflight.size_data_cpus)."""
        return 1.0 if self.cpus_per_worker is None else self.cpus_per_worker

    @property
    def max_workers(self) -> int:
        nw = self.num_workers
        return nw[1] if isinstance(nw, tuple) else nw

    @property
    def min_workers(self) -> int:
        nw = self.num_workers
        return nw[0] if isinstance(nw, tuple) else nw


@dataclass
class ModelConfig:
    """What network is trained."""

    example: ClassVar[str] = ("python -m raytrain.fit --dataset digits --model resnet18 --stem "
                              "cifar")

    model: str = _opt("seed-cnn", "seed-cnn (the seed DDP script's Net: 2 convs, fc 4096-512-"
                      "classes), lenet (LeNet-5, fastest), small-cnn (a fast BatchNorm CNN), "
                      "resnet18 or any torchvision classification model name")
    pretrained: str | None = _opt(None, "local weights file (state_dict) to start from; the "
                                  "classifier head is replaced to fit the classes")
    stem: str = _opt("auto", "ResNets' stem: cifar (conv1 stride 1, no max-pool), imagenet "
                     "(torchvision's), auto = cifar for images <= 64 px", choices=STEMS)
    compile: bool = _opt(False, "torch.compile the model (worth it on GPUs for long runs; on "
                         "CPU it works but compiling takes about a minute on 2 cores and the "
                         "compiled step is not faster)")

    def __post_init__(self) -> None:
        check_model_name(self.model)
        _check(self.stem in STEMS, "stem", self.stem, "one of " + ", ".join(STEMS))
        if self.pretrained is not None:
            _check(os.path.isfile(self.pretrained), "pretrained", self.pretrained,
                   "an existing weights file")


@dataclass
class DataConfig:
    """What data is trained on."""

    example: ClassVar[str] = ("python -m raytrain.fit --dataset imagefolder --data-dir "
                              "./digits-folder --image-size 32")

    dataset: str = _opt("cifar10", "dataset: a built-in one (loaded whole into every worker), "
                        "or your own images streamed by Ray Data: imagefolder (DIR/train/"
                        "<class>/*, DIR/val/<class>/*) or parquet (DIR/train/*.parquet, "
                        "DIR/val/*.parquet, DIR/classes.json; python -m raytrain.pack)",
                        choices=DATASETS)
    data_dir: str | None = _opt(None, "directory holding (or receiving) the dataset files; "
                                "default ~/.cache/raytrain/data. imagefolder/parquet: required, "
                                "a path every node sees or an s3:// / gs:// URI")
    augment: bool | None = _opt(None, "random crop + horizontal flip where labels allow it "
                                "(default: on for cifar and your own images (random-resized "
                                "crop), crop only for digits, off for synthetic)")
    synthetic_size: int = _opt(6400, "training images in --dataset synthetic")
    normalize: str = _opt("dataset", "input scaling: dataset = subtract the dataset's mean, "
                          "divide by its std (ImageNet's for imagefolder/parquet); none = "
                          "ToTensor()'s [0, 1]; half = Normalize(0.5, 0.5)'s [-1, 1]",
                          choices=NORMALIZATIONS)
    image_size: int | None = _opt(None, "side of the square training/eval crops in pixels "
                                  "(default 224 for imagefolder/parquet; the built-ins are 32)")
    data_cpus: float | None = _opt(None, "imagefolder/parquet: CPUs kept free of workers for Ray "
                                   "Data's read/decode tasks (default: all the workers leave, at "
                                   "least 1; workers get less than --cpus-per-worker's default 1 "
                                   "where that is needed)")
    decode: str = _opt("tasks", "imagefolder/parquet: where images are decoded and cropped: tasks "
                       "= Ray Data tasks on the cluster's CPUs; worker = batched torchvision "
                       "decode_jpeg on each worker's device (nvjpeg on a GPU: for nodes with few "
                       "CPUs per GPU)", choices=DECODERS)
    skip_bad_images: bool = _opt(False, "imagefolder/parquet: skip images that cannot be "
                                 "decoded (counted per epoch, listed in events.jsonl) instead "
                                 "of stopping the run")
    progress_every: float = _opt(30.0, "imagefolder/parquet: seconds between in-epoch progress "
                                 "lines (images/s, ETA, data wait); 0 = off")

    def __post_init__(self) -> None:
        _check(self.dataset in DATASETS, "dataset", self.dataset, "one of " + ", ".join(DATASETS))
        _check(self.normalize in NORMALIZATIONS, "normalize", self.normalize,
               "one of " + ", ".join(NORMALIZATIONS))
        _check(self.decode in DECODERS, "decode", self.decode, "one of " + ", ".join(DECODERS))
        _check(self.synthetic_size >= 1, "synthetic_size", self.synthetic_size, "a number >= 1")
        _check(self.progress_every >= 0, "progress_every", self.progress_every, "seconds >= 0")
        _check(self.data_cpus is None or (math.isfinite(self.data_cpus) and self.data_cpus > 0),
               "data_cpus", self.data_cpus, "a number of CPUs > 0")
        if self.streaming:
            _check(self.data_dir is not None, "data_dir", self.data_dir,
                   f"a directory or s3:// / gs:// URI for --dataset {self.dataset}")
            if self.image_size is None:
                self.image_size = 224
            _check(8 <= self.image_size <= 1024, "image_size", self.image_size,
                   "a whole number of pixels in [8, 1024]")
        else:
            _check(self.image_size in (None, 32), "image_size", self.image_size,
                   f"32 for --dataset {self.dataset} (the built-ins are 32x32; other sizes "
                   "with --dataset imagefolder or parquet)")
            self.image_size = 32
        if self.data_dir is not None and "://" not in self.data_dir:
            _check(os.path.isdir(self.data_dir), "data_dir", self.data_dir, "an existing directory")

    @property
    def streaming(self) -> bool:
        """Your own images, streamed by Ray Data (not loaded whole into every worker)."""
        return self.dataset in STREAMING


@dataclass
class RecipeConfig:
    """The recipe pieces of a modern image trainer, each off by default (YAML section: optim)."""

    example: ClassVar[str] = ("python -m raytrain.fit --dataset digits --label-smoothing 0.1 "
                              "--mixup 0.2 --ema 0.999 --warmup-epochs 2")

    label_smoothing: float = _opt(0.0, "cross-entropy label smoothing F (0 <= F < 1)")
    mixup: float = _opt(0.0, "mixup: mix pairs of images and their labels with a Beta(ALPHA, "
                        "ALPHA) weight (0 = off)", metavar="ALPHA")
    cutmix: float = _opt(0.0, "cutmix: paste a box of another image, labels weighted by its "
                         "area, box from Beta(ALPHA, ALPHA) (0 = off; with --mixup, one of the "
                         "two per batch)", metavar="ALPHA")
    ema: float = _opt(0.0, "keep an exponential moving average of the weights with this decay "
                      "per step (e.g. 0.999; 0 = off); evaluated each epoch as test_acc_ema, "
                      "and model.pt holds the better of the two", metavar="DECAY")
    warmup_epochs: int = _opt(0, "linear learning-rate warmup over the first N epochs, then the "
                              "schedule")
    grad_accum: int = _opt(1, "accumulate gradients over N steps per update: --batch-size "
                           "(global) = N x the per-step batch; DDP all-reduces once per update")
    clip_grad: float = _opt(0.0, "clip the gradients' global norm to NORM (0 = off)",
                            metavar="NORM")

    def __post_init__(self) -> None:
        _check(math.isfinite(self.label_smoothing) and 0 <= self.label_smoothing < 1,
               "label_smoothing", self.label_smoothing, "a number in [0, 1)")
        for key in ("mixup", "cutmix", "clip_grad"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value >= 0, key, value, "a finite number >= 0 "
                   "(0 = off)")
        _check(math.isfinite(self.ema) and 0 <= self.ema < 1, "ema", self.ema,
               "a decay in [0, 1), e.g. 0.999 (0 = off)")
        _check(self.grad_accum >= 1, "grad_accum", self.grad_accum, "a whole number >= 1")


@dataclass
class OptimConfig(RecipeConfig):
    """How the network is trained. Learning rate and batch size are global."""

    example: ClassVar[str] = ("python -m raytrain.fit --dataset digits --optimizer adamw --lr "
                              "0.003 --lr-schedule cosine --precision bf16")

    epochs: int = _opt(None, "passes over the training set (default: 15 for digits, else 30)")
    batch_size: int = _opt(None, "GLOBAL batch: each worker gets batch_size // num_workers "
                           "(default: 64 for digits, else 128)")
    lr: float = _opt(0.05, "peak learning rate, for the global batch")
    momentum: float = _opt(0.9, "SGD momentum (AdamW beta1)")
    weight_decay: float = _opt(5e-4, "L2 weight decay")
    optimizer: str = _opt("sgd", "optimizer", choices=OPTIMIZERS)
    lr_schedule: str = _opt("onecycle", "learning-rate schedule over all steps",
                            choices=LR_SCHEDULES)
    precision: str = _opt("auto", "autocast dtype; auto = bf16 on GPU, fp32 on CPU (on CPU "
                          "bf16 and fp16 work too; fp16 is several times slower there)",
                          choices=PRECISIONS)
    nan_policy: str = _opt("stop", "on a NaN/inf loss: stop the run, or skip the step",
                           choices=NAN_POLICIES)

    def __post_init__(self) -> None:
        if self.epochs is None or self.batch_size is None:
            return  # TrainConfig sets them by dataset (DATASET_DEFAULTS), then checks
        _check(self.epochs >= 1, "epochs", self.epochs, "a whole number >= 1")
        _check(self.batch_size >= 1, "batch_size", self.batch_size, "a whole number >= 1")
        _check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "a finite number > 0")
        _check(math.isfinite(self.momentum) and 0 <= self.momentum < 1, "momentum",
               self.momentum, "a number in [0, 1)")
        _check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
               self.weight_decay, "a finite number >= 0")
        super().__post_init__()  # the recipe's own checks
        _check(0 <= self.warmup_epochs < self.epochs, "warmup_epochs", self.warmup_epochs,
               f"a whole number in [0, --epochs) = [0, {self.epochs})")
        for key, choices in (("optimizer", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES),
                             ("precision", PRECISIONS), ("nan_policy", NAN_POLICIES)):
            value = getattr(self, key)
            _check(value in choices, key, value, "one of " + ", ".join(choices))


@dataclass
class StorageConfig:
    """Where run directories and checkpoints live, and how many are kept (YAML section: run)."""

    example: ClassVar[str] = ("python -m raytrain.fit --dataset digits --storage-path "
                              "/mnt/efs/runs --shared-storage --keep-checkpoints 3")

    storage_path: str = _opt("./runs", "where run directories and checkpoints live: a path "
                             "(shared by all nodes for multi-node runs) or an s3://BUCKET/PREFIX "
                             "or gs://BUCKET/PREFIX URI (also for --tune, with --scheduler asha "
                             "or none)")
    shared_storage: bool = _opt(False, "declare --storage-path shared by all nodes (an NFS "
                                "mount), allowing a local path for a multi-node run")
    checkpoint_every: int = _opt(1, "save a full training checkpoint every N epochs (and at "
                                 "the end)")
    keep_checkpoints: int = _opt(2, "checkpoints kept at most: the newest and the best by test_acc")

    def __post_init__(self) -> None:
        _check(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every,
               "a whole number >= 1")
        _check(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints,
               "a whole number >= 1")
        if "://" in self.storage_path:  # a bucket: Ray Train and raytrain write through pyarrow
            scheme, _, rest = self.storage_path.partition("://")
            _check(scheme.lower() in STORAGE_SCHEMES and rest.strip("/") != "", "storage_path",
                   self.storage_path, "a file-system path or an s3://BUCKET[/PREFIX] or "
                   "gs://BUCKET[/PREFIX] URI")
            self.storage_path = f"{scheme.lower()}://{rest.rstrip('/')}"
        else:
            self.storage_path = os.path.abspath(os.path.expanduser(self.storage_path))


@dataclass
class RunSettings(StorageConfig):
    """Naming, seed and logging of one run, and the flags that say what to do with it."""

    example: ClassVar[str] = ("python -m raytrain.fit --dataset digits --name digits-a --seed 1 "
                              "--dry-run")

    name: str | None = _opt(None, "run name; the run directory is STORAGE_PATH/NAME "
                            "(default: run-YYYYmmdd-HHMMSS)")
    seed: int = _opt(0, "seed for weights, shuffling and augmentation")
    log_every: int = _opt(0, "print the seed's loss line every N batches on rank 0 (0 = off)")
    verbose: bool = _opt(False, "show Ray Train's own INFO logs")

    def __post_init__(self) -> None:
        if self.name is None:
            self.name = time.strftime("run-%Y%m%d-%H%M%S")
        _check(bool(self.name) and "/" not in self.name and self.name not in (".", ".."),
               "name", self.name, "a non-empty name without '/'")
        _check(self.log_every >= 0, "log_every", self.log_every, "a whole number >= 0")
        super().__post_init__()  # the storage checks


@dataclass
class TrackingConfig:
    """Experiment tracking: the driver logs runs to MLflow (pip install 'raytrain[mlflow]')."""

    example: ClassVar[str] = ("python -m raytrain.fit --dataset digits --mlflow-uri "
                              "http://127.0.0.1:5000 --mlflow-experiment searches")

    mlflow_uri: str | None = _opt(None, "MLflow tracking URI (http://HOST:PORT of `mlflow "
                                  "server`, or sqlite:///FILE): log this run there, or a "
                                  "--tune search as a parent run with a child per trial; "
                                  "default $MLFLOW_TRACKING_URI, else off ('' = off)",
                                  metavar="URI")
    mlflow_experiment: str = _opt("raytrain", "MLflow experiment the runs go in (made if "
                                  "missing)")

    def __post_init__(self) -> None:
        _check(bool(str(self.mlflow_experiment).strip()), "mlflow_experiment",
               self.mlflow_experiment, "a non-empty experiment name")
        uri = self.uri
        if uri is None:
            return
        source = None if self.mlflow_uri else "$MLFLOW_TRACKING_URI"
        if re.fullmatch(r"[\w.-]+:\d+", uri):  # mlflow would take it for a directory
            raise ConfigError("mlflow_uri", uri, "a URI with its scheme, e.g. "
                              f"http://{uri} (or sqlite:///FILE)", source)
        import importlib.util

        if importlib.util.find_spec("mlflow") is None:
            raise ConfigError("mlflow_uri", uri, "mlflow installed: pip install "
                              "\".[mlflow]\" (or 'raytrain[mlflow]'), or no tracking URI",
                              source)

    @property
    def uri(self) -> str | None:
        """--mlflow-uri, else $MLFLOW_TRACKING_URI; None: no tracking."""
        if self.mlflow_uri is not None:
            return self.mlflow_uri.strip() or None
        return os.environ.get("MLFLOW_TRACKING_URI", "").strip() or None


SCHEDULERS = ("asha", "pbt", "none")
SEARCHES = ("random", "optuna")


@dataclass
class TuneSettings:
    """Tune: search lr and batch size over many trainings (--tune); other flags stay fixed."""

    example: ClassVar[str] = ("python -m raytrain.fit --tune --num-workers 1 --dataset digits "
                              "--num-samples 4 --epochs 4")

    tune: bool = _opt(False, "run a Ray Tune search over --lr-range and --batch-sizes instead "
                      "of one training run; results in STORAGE_PATH/NAME")
    num_samples: int = _opt(8, "trials (with an lr list: repeats of the list)")
    lr_range: Any = _opt("1e-4:1e-1", "LO:HI samples lr log-uniformly; V1,V2,... tries each "
                         "value (global-batch lr)", metavar="LO:HI|V1,V2,..")
    batch_sizes: Any = _opt("32,64,128,256", "global batch sizes to choose from",
                            metavar="B1,B2,..")
    scheduler: str = _opt("asha", "asha stops weak trials early, pbt copies strong trials' "
                          "checkpoints and mutates lr/batch, none runs every trial to the end",
                          choices=SCHEDULERS)
    grace_period: int = _opt(1, "ASHA: epochs every trial runs before it can be stopped")
    reduction_factor: int = _opt(2, "ASHA: 1/N of the trials go on at each rung")
    perturbation_interval: int = _opt(2, "PBT: epochs between exploit/explore steps")
    search: str = _opt("random", "random sampling, or optuna (TPE; pip install "
                       "'raytrain[tune]')", choices=SEARCHES)
    max_concurrent_trials: int | None = _opt(None, "trials at once (default: as many as the "
                                             "cluster can place: CPUs // (num_workers x "
                                             "cpus_per_worker), GPUs likewise)")

    def __post_init__(self) -> None:
        _check(self.num_samples >= 1, "num_samples", self.num_samples, "a whole number >= 1")
        self.lr_range = _normalize_list(self.lr_range)
        self.lr_space()  # raises on a bad value
        self.batch_sizes = _normalize_list(self.batch_sizes)
        self.batch_size_choices()
        for key, choices in (("scheduler", SCHEDULERS), ("search", SEARCHES)):
            value = getattr(self, key)
            _check(value in choices, key, value, "one of " + ", ".join(choices))
        _check(self.grace_period >= 1, "grace_period", self.grace_period, "a whole number >= 1")
        _check(self.reduction_factor >= 2, "reduction_factor", self.reduction_factor,
               "a whole number >= 2")
        _check(self.perturbation_interval >= 1, "perturbation_interval",
               self.perturbation_interval, "a whole number >= 1")
        _check(self.max_concurrent_trials is None or self.max_concurrent_trials >= 1,
               "max_concurrent_trials", self.max_concurrent_trials, "a whole number >= 1")
        if self.tune and self.search == "optuna":  # trials run with tune off: no check there
            import importlib.util

            _check(importlib.util.find_spec("optuna") is not None, "search", "optuna",
                   "random, or install optuna first (pip install 'raytrain[tune]')")
            _check(self.scheduler != "pbt", "search", "optuna",
                   "random with --scheduler pbt (PBT makes its own configs)")

    def lr_space(self) -> tuple[str, list[float]]:
        """("range", [lo, hi]) for LO:HI, or ("values", [v1, ...])."""
        accepted = "LO:HI with 0 < LO < HI, or a list of numbers > 0 (V1,V2,...)"
        text = self.lr_range
        parts = text.split(":") if ":" in text else text.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ConfigError("lr_range", text, accepted) from None
        ok = all(math.isfinite(v) and v > 0 for v in values)
        if ":" in text:
            _check(ok and len(values) == 2 and values[0] < values[1], "lr_range", text, accepted)
            return "range", values
        _check(ok, "lr_range", text, accepted)
        return "values", values

    def batch_size_choices(self) -> list[int]:
        accepted = "whole numbers >= 1, comma-separated (B1,B2,...)"
        try:
            values = [int(p) for p in self.batch_sizes.split(",")]
        except ValueError:
            raise ConfigError("batch_sizes", self.batch_sizes, accepted) from None
        _check(all(v >= 1 for v in values), "batch_sizes", self.batch_sizes, accepted)
        return values


def _normalize_list(value: Any) -> str:
    """A YAML list/number or a CLI string -> "a,b,c" / "lo:hi" (what to_flat writes back)."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value).strip().strip("[]").replace(" ", "")


# --help's groups, in --help's order: each lists the fields its dataclass declares itself
# (RecipeConfig's and StorageConfig's fields are inherited by OptimConfig and RunSettings);
# each dataclass's `example` is its group's example line in --help and docs/flags.md.
GROUPS = {"run": RunSettings, "data": DataConfig, "model": ModelConfig,
          "optimisation": OptimConfig, "recipe": RecipeConfig, "Tune": TuneSettings,
          "cluster": ClusterConfig, "storage": StorageConfig, "tracking": TrackingConfig}

# the config's sections: TrainConfig's attributes and the YAML section names
# Defaults that depend on the data. digits (1,437 training images): 15 epochs of 23 steps
# reach test_acc 1.0000, 0.9972, 0.9972 on seeds 0-2 (torchrun -m raytrain.loop, 2 ranks),
# where 30 epochs of 11 steps gave 1.0000 but 15 of 11 gave 0.9889 twice and 20 of 11
# 0.9944/0.9917: more, smaller steps learn it sooner, in half the epochs (issue #27).
DATASET_DEFAULTS: dict[str | None, dict[str, int]] = {
    "digits": {"epochs": 15, "batch_size": 64}, None: {"epochs": 30, "batch_size": 128}}

SECTIONS = {"cluster": ClusterConfig, "model": ModelConfig, "data": DataConfig,
            "optim": OptimConfig, "run": RunSettings, "tune": TuneSettings,
            "tracking": TrackingConfig}


def own_fields(cls: type) -> list[dataclasses.Field]:
    """The fields ``cls`` declares itself, not those of the dataclasses it extends."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                 for f in dataclasses.fields(base)}
    return [f for f in dataclasses.fields(cls) if f.name not in inherited]


def _check(ok: bool, key: str, value: Any, accepted: str) -> None:
    if not ok:
        raise ConfigError(key, value, accepted)


@dataclass
class TrainConfig:
    """The whole resolved config of one run; derived values are properties."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunSettings = field(default_factory=RunSettings)
    tune: TuneSettings = field(default_factory=TuneSettings)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.optim.epochs is None or self.optim.batch_size is None:
            for key, value in DATASET_DEFAULTS.get(self.data.dataset, DATASET_DEFAULTS[None]
                                                   ).items():
                if getattr(self.optim, key) is None:
                    setattr(self.optim, key, value)
            self.optim.__post_init__()
        _check(self.optim.batch_size >= self.cluster.max_workers, "batch_size",
               self.optim.batch_size,
               f"at least --num-workers ({self.cluster.max_workers}): the batch is global")
        accum = self.optim.grad_accum
        _check(self.optim.batch_size >= self.cluster.max_workers * accum, "grad_accum", accum,
               f"at most --batch-size / --num-workers = {self.per_worker_batch} (each of the "
               "accumulated steps needs an image per worker)")
        if self.tune.tune:  # trials run with tune off: checked once, on the driver
            check_search(self)

    @property
    def per_worker_batch(self) -> int:
        return self.optim.batch_size // self.cluster.max_workers

    @property
    def run_location(self) -> str:
        """Where the run lives: STORAGE_PATH/NAME, a local path or a bucket URI."""
        if "://" in self.run.storage_path:
            return f"{self.run.storage_path}/{self.run.name}"
        return os.path.join(self.run.storage_path, self.run.name)

    @property
    def run_dir(self) -> str:
        """The run's files on this machine: ``run_location`` itself, or for a bucket the
        driver's local mirror of raytrain's run files (see raytrain/storage.py)."""
        return local_dir(self.run_location)

    def to_flat(self) -> dict[str, Any]:
        """The config as one flat dict (YAML and Ray's train_loop_config)."""
        flat: dict[str, Any] = {}
        for section in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        nw = flat["num_workers"]
        flat["num_workers"] = f"{nw[0]}:{nw[1]}" if isinstance(nw, tuple) else nw
        return flat

    @classmethod
    def from_flat(cls, flat: dict[str, Any], sources: dict[str, str] | None = None
                  ) -> "TrainConfig":
        """Build and validate; ``sources`` maps a key to the YAML file it came from."""
        unknown = set(flat) - set(FIELDS)
        if unknown:
            key = sorted(unknown)[0]
            raise ConfigError(key, flat[key], "a known key (see --help)",
                              source=(sources or {}).get(key, "config"))
        try:
            parts = {name: sec(**{k: v for k, v in flat.items() if FIELDS[k][0] == name})
                     for name, sec in SECTIONS.items()}
            return cls(**parts)
        except ConfigError as err:
            if sources and err.key in sources:
                raise ConfigError(err.key, err.value, err.accepted, sources[err.key]) from None
            raise
        except TypeError as err:  # e.g. a YAML list where a number belongs
            raise RaytrainError(f"config: {err}") from None


def check_search(cfg: TrainConfig) -> None:
    """--tune's checks that span sections (each section checked its own fields)."""
    t, epochs = cfg.tune, cfg.optim.epochs
    if "://" in cfg.run.storage_path and t.scheduler == "pbt":  # tune/pbt.py: a trial's
        # starting state is written on its node's disk and read there by its Train workers
        raise ConfigError("scheduler", t.scheduler, "asha or none with a bucket --storage-path "
                          "(PBT hands training state between trials through local disk)")
    for size in t.batch_size_choices():
        if size < cfg.cluster.max_workers:
            raise ConfigError("batch_sizes", t.batch_sizes, f"sizes of at least --num-workers "
                              f"({cfg.cluster.max_workers}): the batch is global")
    if t.scheduler == "asha" and t.grace_period > epochs:
        raise ConfigError("grace_period", t.grace_period, f"at most --epochs ({epochs})")
    if t.scheduler == "pbt" and t.perturbation_interval >= epochs:
        raise ConfigError("perturbation_interval", t.perturbation_interval,
                          f"less than --epochs ({epochs}) or PBT never perturbs")


# key -> (section name, dataclasses.Field)
FIELDS: dict[str, tuple[str, dataclasses.Field]] = {
    f.name: (name, f) for name, sec in SECTIONS.items() for f in dataclasses.fields(sec)
}

