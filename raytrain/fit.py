"""``python -m raytrain.fit``: train an image classifier data-parallel on a Ray cluster.

    python -m raytrain.fit --num-workers 2 --dataset digits
    python -m raytrain.fit --num-workers 8 --use-gpu --model resnet18 --dataset cifar10

Exit codes: 0 done, 1 training failed, 2 bad input, 130 interrupted (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import yaml

STARTED_AT = time.time()

from raytrain.config import (FIELDS, SECTIONS, ConfigError, RaytrainError,  # noqa: E402
                             TrainConfig, coerce)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"raytrain: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Flags come from the config dataclasses' fields; nothing is listed twice."""
    p = _Parser(prog="raytrain-fit", argument_default=argparse.SUPPRESS,
                description="Train an image classifier data-parallel on a Ray cluster "
                "(Ray Train TorchTrainer + DDP). --batch-size and --lr are GLOBAL: each of N "
                "workers gets batch_size // N images per step.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="YAML", help="YAML file of settings (keys = flag names "
                   "with _ ); flags given on the command line override it")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, resources and per-worker batch; start nothing")
    p.add_argument("--resume", action="store_true",
                   help="continue an existing run of this --name even if its config differs")
    p.add_argument("--fresh", action="store_true",
                   help="delete an existing run of this --name and start over")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section, (cls.__doc__ or "").strip())
        for f in dataclasses.fields(cls):
            _add_flag(group, f)
    return p


def _add_flag(group, f: dataclasses.Field) -> None:
    meta, flag = f.metadata, "--" + f.name.replace("_", "-")
    default = f.default
    help_text = meta["help"] + ("" if default is None else f" (default: {default})")
    if "flags" in meta:  # an on/off pair with custom names, e.g. --use-gpu / --no-gpu
        on, off = meta["flags"]
        group.add_argument(on, dest=f.name, action="store_const", const=True, help=help_text)
        group.add_argument(off, dest=f.name, action="store_const", const=False,
                           help=f"opposite of {on}")
    elif str(f.type).startswith("bool"):
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           help=meta["help"])
    else:
        choices = meta.get("choices")
        metavar = meta.get("metavar") or ("{" + ",".join(choices) + "}" if choices
                                          else f.name.upper())
        group.add_argument(flag, dest=f.name, metavar=metavar, help=help_text)


def load_yaml(path: str) -> dict[str, Any]:
    """Flat (``lr: 0.1``) or sectioned (``optim: {lr: 0.1}``) YAML settings."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError("config", path, "an existing YAML file") from None
    except (OSError, yaml.YAMLError) as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise ConfigError("config", path, f"valid YAML (parse error{at})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", path, "a YAML mapping of setting: value")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return {str(k).replace("-", "_"): v for k, v in flat.items()}


def resolve(args: argparse.Namespace) -> TrainConfig:
    """defaults <- YAML <- flags, each value converted and checked once."""
    given = {k: v for k, v in vars(args).items() if k in FIELDS}
    from_yaml = load_yaml(args.config) if getattr(args, "config", None) else {}
    sources = {k: os.path.basename(args.config) for k in from_yaml if k not in given}
    merged = {**from_yaml, **given}
    flat = {}
    for key, value in merged.items():
        if key not in FIELDS:
            raise ConfigError(key, value, "a known setting (see --help)", sources.get(key))
        try:
            flat[key] = coerce(key, value)
        except ConfigError as err:
            raise ConfigError(key, value, err.accepted, sources.get(key)) from None
    return TrainConfig.from_flat(flat, sources)


def dry_run_text(cfg: TrainConfig) -> str:
    c = cfg.cluster
    lines = ["resolved config:", yaml.safe_dump(cfg.to_flat(), sort_keys=False).rstrip(),
             f"workers: {c.num_workers} x {c.cpus_per_worker:g} CPU"
             + {True: " + 1 GPU", False: "", None: " (+ 1 GPU each if the cluster has GPUs)"}[
                 c.use_gpu],
             f"batch: {cfg.optim.batch_size} global = {cfg.per_worker_batch} per worker x "
             f"{c.max_workers} workers",
             f"run directory: {cfg.run_dir}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        cfg = resolve(args)
        if getattr(args, "dry_run", False):
            print(dry_run_text(cfg))
            return 0
        from raytrain import launch

        launch.check_data(cfg)
        started_cluster = launch.connect(cfg.cluster.address, cfg.run.verbose,
                                          cfg.cluster.keep_cluster)
        try:
            run = launch.fit
            if cfg.tune.tune:  # a search: many runs, see raytrain/tune.py
                from raytrain import tune as tuning

                run = tuning.run
            summary = run(cfg, STARTED_AT, resume=getattr(args, "resume", False),
                          fresh=getattr(args, "fresh", False))
        finally:
            if started_cluster:
                import ray

                ray.shutdown()
    except RaytrainError as err:
        if debug:
            raise
        from raytrain.launch import Interrupted, TrainingError

        print(f"raytrain: error: {err}", file=sys.stderr, flush=True)
        if isinstance(err, Interrupted):
            return 130
        return 1 if isinstance(err, TrainingError) else 2
    except KeyboardInterrupt:
        print("raytrain: interrupted; workers stopped", file=sys.stderr)
        return 130
    if cfg.tune.tune:
        tuning.print_summary(summary)
    else:
        print_summary(summary)
    return 0


def print_summary(summary) -> None:
    from raytrain.report import final_line, summary_table

    print()
    print(summary_table(summary.rows))
    if summary.rows:
        print(final_line(summary.rows))
    if summary.first_step_s is not None:
        phases = " + ".join(f"{name} {sec:.1f}" for name, sec in summary.startup or [])
        print(f"time to first step {summary.first_step_s:.1f}s"
              + (f" = {phases}" if phases else "") + f"; wall time {summary.wall_s:.1f}s")
    print(f"run directory: {summary.run_dir}")
    if summary.model_path:
        print(f"weights: {summary.model_path}")


def main_cli() -> None:
    """Console script ``raytrain-fit``."""
    sys.exit(main())


if __name__ == "__main__":
    main_cli()
