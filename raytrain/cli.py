"""The command line: flags derived from the config dataclasses, YAML merged under them.

    from raytrain.cli import build_parser, resolve
    cfg = resolve(build_parser().parse_args(["--dataset", "digits", "--lr", "0.1"]))
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import yaml

from raytrain.config import (FIELDS, GROUPS, SECTIONS, RunSettings, TrainConfig,
                             own_fields)
from raytrain.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"raytrain: error: {message} (see --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Group descriptions as written: the dataclass's docstring, then its example line."""


def build_parser() -> argparse.ArgumentParser:
    """Flags come from the config dataclasses' fields, one --help group per dataclass (config.
    GROUPS); nothing is listed twice."""
    p = _Parser(prog="raytrain-fit", argument_default=argparse.SUPPRESS,
                description="Train an image classifier data-parallel on a Ray cluster "
                "(Ray Train TorchTrainer + DDP).\n--batch-size and --lr are GLOBAL: each of N "
                "workers gets batch_size // N images per step.\nEvery flag is also a YAML key "
                "(--batch-size -> batch_size:) for --config; docs/flags.md lists them all.",
                formatter_class=_Formatter)
    for title, cls in GROUPS.items():
        group = p.add_argument_group(title, group_description(cls))
        if cls is RunSettings:
            _add_run_actions(group)
        for f in own_fields(cls):
            _add_flag(group, f)
    return p


def group_description(cls: type) -> str:
    doc = " ".join((cls.__doc__ or "").split())
    return f"{doc}\n  e.g. {cls.example}"


def _add_run_actions(group) -> None:
    """The flags that say what to do with a run, not how to train: no config field."""
    group.add_argument("--config", metavar="YAML", help="YAML file of settings (keys = flag "
                       "names with _ ); flags given on the command line override it")
    group.add_argument("--dry-run", action="store_true", help="print the resolved config, "
                       "resources and per-worker batch; start nothing")
    group.add_argument("--resume", action="store_true",
                       help="continue an existing run of this --name even if its config differs")
    group.add_argument("--fresh", action="store_true",
                       help="delete an existing run of this --name and start over")
    group.add_argument("--debug", action="store_true", help="show tracebacks on errors")


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


def coerce(key: str, value: Any) -> Any:
    """Convert a CLI/YAML value to the field's type, naming the key when it can't be."""
    f = FIELDS[key][1]
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    if value is None or key == "num_workers":
        return value
    try:
        if kind.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind.startswith("float"):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            raise ValueError
    except (TypeError, ValueError):
        accepted = {"i": "a whole number", "f": "a number", "b": "true or false"}[kind[0]]
        raise ConfigError(key, value, accepted) from None
    return str(value) if kind.startswith("str") else value
