"""``python -m raytrain.predict MODEL --data-dir DIR --out FILE``: label images at scale on Ray.

    python -m raytrain.predict runs/my-run --data-dir s3://bucket/new-images --out preds.parquet \\
        --batch-size 512 --use-gpu --num-workers 4 --top-k 5
    python -m raytrain.predict runs/my-run/model.pt --model resnet50 --classes classes.json \\
        --data-dir /mnt/photos --out preds.csv

MODEL: a run directory (config.yaml, classes.json, model.pt), a checkpoint directory or its
state.pt, or a bare model.pt (then --model, and --classes or class indices), local or s3:// /
gs://. Rows (one per image file): path, class, label, prob, topk_class/topk_prob with --top-k,
error (empty, or why the file could not be read). See docs/predict.md.

Exit codes: 0 done, 1 the run failed, 2 bad input, 130 interrupted (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

from raytrain.config import NORMALIZATIONS, STEMS, _opt
from raytrain.errors import EXIT_INTERRUPTED, EXIT_OK, ConfigError, RaytrainError, exit_code


@dataclass
class PredictConfig:
    """What to label, with which model, where the rows go and on how many workers."""

    model_path: str = _opt(None, "run dir, checkpoint dir, state.pt or model.pt (local or "
                           "s3:// / gs://)", positional=True, metavar="MODEL")
    data_dir: str = _opt(None, "images to label: a folder or s3:// / gs:// URI, searched "
                         "recursively (class folders allowed, ignored), or Parquet files with "
                         "an image column (raytrain.pack's layout)")
    out: str = _opt(None, "predictions file: FILE.parquet or FILE.csv, local or in a bucket; "
                    "replaced whole at the end")
    batch_size: int = _opt(256, "images per forward pass on each worker")
    num_workers: int = _opt(1, "inference workers (Ray Data actors, each holding the model)")
    use_gpu: bool = _opt(False, "one GPU per worker (bf16 + channels_last where the GPU has "
                         "them)")
    top_k: int = _opt(1, "also write the K most likely classes and their probabilities "
                      "(topk_class, topk_prob) when K > 1")
    model: str | None = _opt(None, "network of a bare model.pt (a run's config names it)")
    classes: str | None = _opt(None, "JSON list of class names in label order (default: the "
                               "run's classes.json, else indices)")
    image_size: int | None = _opt(None, "crop side in pixels (default: the run's; bare "
                                  "model.pt: 32 for seed-cnn/lenet/small-cnn, else 224)")
    stem: str | None = _opt(None, "ResNet stem (default: the run's, else auto)", choices=STEMS)
    normalize: str | None = _opt(None, "input scaling (default: the run's, else ImageNet's "
                                 "mean/std)", choices=NORMALIZATIONS)
    cpus_per_worker: float | None = _opt(None, "logical CPUs per worker (default 1, or less "
                                         "where 1 would leave the decode tasks under "
                                         "--data-cpus)")
    data_cpus: float | None = _opt(None, "CPUs the workers must leave for the decode tasks "
                                   "(default 1; the tasks use every CPU left)")
    address: str | None = _opt(None, "existing Ray cluster (auto or HOST:PORT); default "
                               "$RAY_ADDRESS, else a new local cluster")
    wait_timeout: float = _opt(60.0, "seconds to wait for room for the workers (CPUs or GPUs "
                               "that other jobs hold) before failing")
    progress_every: float = _opt(10.0, "seconds between progress lines; 0 = off")
    verbose: bool = _opt(False, "Ray's and Ray Data's own logs and progress bars")

    def __post_init__(self) -> None:
        from raytrain.model_names import check_model_name

        for key in ("data_dir", "out"):
            if not getattr(self, key):
                raise ConfigError(key, getattr(self, key), "a value (it is required)")
        checks = [("batch_size", self.batch_size >= 1, "a whole number >= 1"),
                  ("num_workers", self.num_workers >= 1, "a whole number >= 1"),
                  ("top_k", self.top_k >= 1, "a whole number >= 1"),
                  ("image_size", self.image_size is None or 8 <= self.image_size <= 1024,
                   "a whole number of pixels in [8, 1024]"),
                  ("cpus_per_worker", _positive(self.cpus_per_worker), "a number > 0"),
                  ("data_cpus", _positive(self.data_cpus), "a number of CPUs > 0"),
                  ("wait_timeout", _positive(self.wait_timeout), "a number of seconds > 0"),
                  ("progress_every", self.progress_every >= 0, "seconds >= 0")]
        for key, ok, accepted in checks:
            if not ok:
                raise ConfigError(key, getattr(self, key), accepted)
        if self.model is not None:
            check_model_name(self.model)


def _positive(value: float | None) -> bool:
    return value is None or (math.isfinite(value) and value > 0)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"raytrain: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Flags from PredictConfig's fields (types from their defaults' annotations)."""
    p = _Parser(prog="raytrain-predict", description="Label images at scale on a Ray cluster "
                "with a trained model: one row per image file (path, class, label, prob, "
                "error) in a Parquet or CSV file.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    for f in dataclasses.fields(PredictConfig):
        meta, kind = f.metadata, str(f.type)
        shown = f.default not in (None, False) and not meta.get("positional")
        kwargs = {"help": meta["help"] + (f" (default: {f.default})" if shown else "")}
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if kind.startswith("bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = int if "int" in kind else float if "float" in kind else str
        if meta.get("positional"):
            p.add_argument(f.name, metavar=meta["metavar"], **kwargs)
        else:
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=f.default,
                           required=f.name in ("data_dir", "out"), **kwargs)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse -> config -> run -> summary."""
    args = build_parser().parse_args(argv)
    try:
        cfg = PredictConfig(**{f.name: getattr(args, f.name)
                               for f in dataclasses.fields(PredictConfig)})
        from raytrain.driver import cluster

        cluster.token_auth_env()  # before anything imports ray
        from raytrain.infer.run import predict

        summary = predict(cfg)
    except RaytrainError as err:
        if args.debug:
            raise
        print(f"raytrain: error: {err}", file=sys.stderr, flush=True)
        return exit_code(err)
    except KeyboardInterrupt:
        print("raytrain: interrupted; no predictions file written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary.text(), flush=True)
    return EXIT_OK


def main_cli() -> None:
    """Console script ``raytrain-predict``."""
    sys.exit(main())


if __name__ == "__main__":
    main_cli()
