"""The package's boundaries (an ast scan, no imports: module sizes, import directions, no
cycles), and ray_compat's fallbacks, each run with its Ray internal made missing.

    python -m pytest -q tests/test_architecture.py
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest

from raytrain import ray_compat
from raytrain.errors import RaytrainError

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "raytrain"
MAX_LINES = 600  # a module past this holds two jobs: split it (issue 29)
# ray_compat's one job is every Ray internal raytrain uses (DESIGN.md: the only module that may
# touch them), so it grows with them and cannot be split: a limit of its own.
MAX_LINES_COMPAT = 860  # 750 until the prestart RPC, 800 until the dashboard thread (2026-12-07)
PRIVATE_RAY = ("ray._private", "ray._raylet")
# Private attributes of Ray objects raytrain reads or overrides: ray_compat's alone.
PRIVATE_ATTRS = {"_experiment_analysis", "_trial_info", "_rungs", "_num_stopped", "_metric",
                 "_time_attr", "_create_default_callbacks", "_initialize_and_run_controller",
                 "_connect_and_get_accessor", "_maybe_send_resource_request"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree: ast.Module, module: str) -> set[str]:
    """Every module ``module`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                pkg = module.split(".")[:-node.level + (1 if module.endswith("__init__") else 0)
                                        or None]
                base = ".".join(pkg + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


MODULES = _modules()
GRAPH = {m: {i for i in _imports(t, m) if i in MODULES and i != m} for m, t in MODULES.items()}


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycles():
    cycles = sorted(m for m in MODULES if m in _reach(m) and m != "raytrain")
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_no_module_over_the_line_limit():
    long = sorted((n, name) for name, n in
                  ((p.relative_to(PACKAGE.parent).as_posix(), len(p.read_text().splitlines()))
                   for p in PACKAGE.rglob("*.py"))
                  if n > (MAX_LINES_COMPAT if name == "raytrain/ray_compat.py" else MAX_LINES))
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _importers(target: str) -> list[str]:
    return sorted(m for m in MODULES if target in GRAPH[m])


def test_worker_never_imports_driver_tune_cli_or_faces():
    # The torchrun entry point (raytrain/loop.py) is a face like fit.py: it takes the CLI's
    # parser and runs worker.loop; nothing under worker/ reaches back to it.
    forbidden = ("raytrain.driver", "raytrain.tune", "raytrain.cli", "raytrain.fit",
                 "raytrain.loop")
    workers = [m for m in MODULES if m.startswith("raytrain.worker")]
    assert "raytrain.worker.loop" in workers and "raytrain.worker.ray_entry" in workers
    for module in workers:
        bad = sorted(m for m in _reach(module) if m.startswith(forbidden))
        assert not bad, f"{module} reaches {bad}"


def test_only_the_faces_import_the_cli():
    assert "raytrain.worker.loop" in GRAPH["raytrain.loop"]  # torchrun's loop is the worker's
    assert _importers("raytrain.cli") == ["raytrain.fit", "raytrain.loop"]


def test_models_know_nothing_of_checkpoints():
    bad = sorted(m for m in _reach("raytrain.models") if m == "raytrain.checkpoint")
    assert not bad, f"raytrain.models reaches {bad}"


def test_config_never_imports_the_model_zoo():
    bad = sorted(m for m in _reach("raytrain.config") if m == "raytrain.models")
    assert not bad, f"raytrain.config reaches {bad}"


def test_model_names_are_the_registrys():
    """config checks --model against plain tuples: they must name what models.py builds."""
    import torchvision

    from raytrain import model_names, models

    assert tuple(models.CUSTOM) == model_names.CUSTOM_MODELS
    assert model_names.TORCHVISION_MODELS == tuple(
        torchvision.models.list_models(module=torchvision.models))


def test_ray_data_tasks_decode_without_torch(tmp_path):
    """A decode task's process imports what it unpickles (data.decode, data.pipeline, pack) and
    decodes; torch is not loaded (it cost each task process 1.3 s, commit ae4ec63)."""
    code = textwrap.dedent("""
        import io, sys
        import numpy as np, pyarrow.fs as pafs
        from PIL import Image
        import raytrain.data.pipeline, raytrain.pack
        from raytrain.data.decode import DecodeFn
        buf = io.BytesIO()
        Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(buf, "PNG")
        out = DecodeFn(pafs.LocalFileSystem(), 8, True, 0)({"image": [buf.getvalue()],
                                                          "label": [1]})
        assert out["image"].shape == (1, 3, 8, 8), out["image"].shape
        print(sorted(m for m in ("torch", "torchvision") if m in sys.modules))
    """)
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_driver_never_imports_tune():
    for module in (m for m in MODULES if m.startswith("raytrain.driver")):
        bad = sorted(m for m in _reach(module) if m.startswith("raytrain.tune"))
        assert not bad, f"{module} reaches {bad}"


def test_only_ray_compat_touches_ray_internals():
    for module, tree in MODULES.items():
        if module == "raytrain.ray_compat":
            continue
        private = sorted(i for i in _imports(tree, module)
                         if i.startswith(PRIVATE_RAY) or "._internal" in i)
        assert not private, f"{module} imports {private}"
        attrs = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
                       & PRIVATE_ATTRS)
        assert not attrs, f"{module} uses Ray's private {attrs}"
        patched = [ast.unparse(t) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   for t in n.targets if ast.unparse(t).startswith("ray.")]
        assert not patched, f"{module} monkeypatches {patched}"


# ---------------------------------------------------------------------------- fallbacks


@pytest.fixture
def missing(monkeypatch):
    """``missing("ray.x.y")``: ray_compat sees that module (and its attributes) as absent."""
    real = ray_compat._internal
    gone: list[str] = []

    def internal(module, name=None):
        full = f"{module}.{name}" if name else module
        if any(full == g or full.startswith(g + ".") or module == g for g in gone):
            return None
        return real(module, name)

    monkeypatch.setattr(ray_compat, "_internal", internal)
    monkeypatch.setattr(ray_compat, "_warned", set())

    def forget() -> None:  # the classes ray_compat defined from what it found
        ray_compat._trainer_classes.cache_clear()
        ray_compat._trainer_class.cache_clear()

    def make_missing(module: str) -> None:
        gone.append(module)
        forget()

    forget()
    yield make_missing
    forget()


def _compat_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ray_compat.RayCompatWarning)]


def test_this_ray_has_every_internal():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ray_compat.check()
    assert not _compat_warnings(record)


@pytest.mark.parametrize("key", sorted(ray_compat.FALLBACKS))
def test_check_warns_once_per_missing_fallback(key, missing, monkeypatch):
    present, lost = ray_compat.FALLBACKS[key]
    monkeypatch.setitem(ray_compat.FALLBACKS, key, (lambda: False, lost))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ray_compat.check()
        ray_compat.check()
    assert _compat_warnings(record) == [f"raytrain: this Ray lacks {key} (written for "
                                        f"{ray_compat.WRITTEN_FOR}): {lost}"]


def test_required_internal_missing_is_one_line_at_start_up(missing, tmp_path, capsys):
    from raytrain import fit

    missing("ray.train.v2._internal.execution.storage")
    with pytest.raises(RaytrainError, match="lacks ray.train.v2._internal.execution.storage"):
        ray_compat.check()
    rc = fit.main(["--dry-run", "--dataset", "digits", "--storage-path", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "install ray==2.60.*" in err[0], err
    # A run checks beside Ray's start (preflight.ray_compat_checked): the same line, no run
    rc = fit.main(["--dataset", "digits", "--epochs", "1", "--storage-path", str(tmp_path),
                   "--name", "never"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "install ray==2.60.*" in err[0], err
    assert not (tmp_path / "never").exists()


def test_report_logs_fallback_leaves_logging_alone(missing):
    import logging

    before = dict(logging.Logger.manager.loggerDict)
    missing(ray_compat.TRAIN_CONTEXT_LOGGER)
    ray_compat.quiet_report_logs()  # workers: silent, no error (the driver's check warned)
    assert dict(logging.Logger.manager.loggerDict) == before


def test_state_actor_fallback_leaves_it_to_the_controller(missing):
    missing("ray.train.v2._internal.state.state_actor")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ray_compat.start_train_state_actor()
        ray_compat.start_train_state_actor()
    assert len(_compat_warnings(record)) == 1


def test_cluster_config_fallback_reads_the_bootstrap_config(missing, monkeypatch, tmp_path):
    from raytrain.driver import preflight

    path = tmp_path / "bootstrap.yaml"
    path.write_text("max_workers: 2\navailable_node_types:\n  gpu:\n    max_workers: 2\n"
                    "    resources: {CPU: 8, GPU: 1}\n")
    monkeypatch.setattr(preflight, "BOOTSTRAP_CONFIG", str(path))
    missing("ray._private.state")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        groups = preflight.autoscaling_groups()
        preflight.autoscaling_groups()
    assert groups == [{"resources": {"CPU": 8.0, "GPU": 1.0}, "max_count": 2}]
    assert len(_compat_warnings(record)) == 1


def _trainer(tmp_path):
    """``ray_compat.make_trainer`` for one worker, as the driver calls it."""
    from ray.train import RunConfig, ScalingConfig

    return ray_compat.make_trainer(lambda config: None, fixed_cluster=True,
                                   driver_outlives_run=False,
                                   scaling_config=ScalingConfig(num_workers=1),
                                   run_config=RunConfig(storage_path=str(tmp_path)))


def _twice_missing(missing, module: str, tmp_path) -> tuple[list, list[str]]:
    """Two trainers made with ``module`` missing, and the compat warnings that gave."""
    missing(module)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainers = [_trainer(tmp_path), _trainer(tmp_path)]
    return trainers, _compat_warnings(record)


def test_trainer_fallback_is_ray_trainer_unchanged(missing, tmp_path):
    from ray.train.torch import TorchTrainer

    assert type(_trainer(tmp_path)).__name__ == "Trainer"  # this Ray: raytrain's trainer
    trainers, said = _twice_missing(missing, "ray.train.v2._internal.callbacks.datasets",
                                    tmp_path)
    assert all(type(t) is TorchTrainer for t in trainers)
    assert len(said) == 1


def test_torch_backend_fallback_is_rays_torch_config(missing, tmp_path):
    from ray.train.torch import TorchConfig

    mine = _trainer(tmp_path).backend_config
    assert type(mine).__name__ == "TorchBackendConfig" and mine.backend == "gloo"
    assert mine.to_dict() == TorchConfig(backend="gloo").to_dict()  # what the state API shows
    trainers, said = _twice_missing(missing, "ray.train.v2._internal.util", tmp_path)
    assert all(type(t.backend_config) is TorchConfig and t.backend_config.backend == "gloo"
               for t in trainers)
    assert len(said) == 1


def test_placement_group_fallback_turns_the_reaper_off(missing, tmp_path):
    from raytrain.tune.placement import PlacementGroupReaper

    assert ray_compat.can_reap_placement_groups()
    missing("ray._raylet")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert not ray_compat.can_reap_placement_groups()
        assert not ray_compat.can_reap_placement_groups()
    assert len(_compat_warnings(record)) == 1
    with PlacementGroupReaper(str(tmp_path), enabled=False) as reaper:  # no thread, no table
        assert not hasattr(reaper, "_thread")
    missing("ray.train.v2._internal.execution.callback")
    assert ray_compat.worker_group_callback_base() is object


def test_asha_fallback_is_rays_plain_asha(missing, monkeypatch):
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import ASHAScheduler

    from raytrain.tune.asha import LateCheckASHA

    real = ray_compat.asha_rungs
    monkeypatch.setattr(ray_compat, "asha_rungs", lambda s, t: real(object(), t))
    kwargs = dict(time_attr="epoch", metric="test_loss", mode="min", max_t=8, grace_period=1,
                  reduction_factor=2)

    def race(scheduler):
        slow, fast = (Trial("run_trial", trial_id=i, stub=True) for i in ("slow", "fast"))
        for trial in (slow, fast):
            scheduler.on_trial_add(None, trial)
        return [(scheduler.on_trial_result(None, slow, {"epoch": e, "test_loss": 2.3}),
                 scheduler.on_trial_result(None, fast, {"epoch": e, "test_loss": 2.0 / e}))
                for e in range(1, 5)]

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = race(LateCheckASHA(**kwargs))
    assert ours == race(ASHAScheduler(**kwargs))
    assert len(_compat_warnings(record)) == 1


def test_result_grid_fallback_reads_the_saved_state(missing, monkeypatch):
    import ray.tune

    class Analysis:
        def __init__(self, path):
            self.trials = [f"trial from {path}"]

    monkeypatch.setattr(ray.tune, "ExperimentAnalysis", Analysis)

    class Grid:  # a ResultGrid without its private _experiment_analysis
        experiment_path = "/runs/search"

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trials = [ray_compat.result_grid_trials(Grid()) for _ in range(2)]
    assert trials == [["trial from /runs/search"]] * 2
    assert len(_compat_warnings(record)) == 1


def test_data_execution_index_fallback_seeds_crops_by_image_alone(monkeypatch):
    """A Ray without DataContext._execution_idx: every epoch reads as epoch 0 (one warning), and
    a resumed run's start index is not set; decoding goes on."""
    from ray.data import DataContext

    from raytrain.data import decode

    class OldContext:  # a DataContext of a Ray that keeps no execution count
        pass

    monkeypatch.setattr(DataContext, "get_current", staticmethod(lambda: OldContext()))
    ray_compat._warned.discard(ray_compat.DATA_EXECUTION_INDEX)
    ctx = OldContext()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ray_compat.set_data_execution_index(ctx, 5)
        assert decode.epoch_index() == 0 and decode.epoch_index() == 0
    assert not hasattr(ctx, "_execution_idx")


def test_checkpoint_snapshot_fallback_counts_every_complete_checkpoint(missing, tmp_path):
    import torch

    from raytrain.driver.run import latest_checkpoint_epoch, prune_checkpoints

    for epoch in (1, 2):
        (tmp_path / f"checkpoint_epoch_{epoch:04d}").mkdir()
        torch.save({"w": torch.zeros(1)}, tmp_path / f"checkpoint_epoch_{epoch:04d}" / "state.pt")
    assert latest_checkpoint_epoch(str(tmp_path)) == 0  # Ray registered none of them
    missing("ray.train.v2._internal.constants")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert latest_checkpoint_epoch(str(tmp_path)) == 2
        prune_checkpoints(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_epoch_0001", "checkpoint_epoch_0002"]
    assert len(_compat_warnings(record)) == 1


def test_setup_hook_fallback_is_no_env_var(missing):
    missing("ray._private.ray_constants")
    assert ray_compat.setup_hook_env("raytrain.worker.warm.start") == {}


def test_prestart_fallback_asks_nothing(missing):
    missing("ray.core.generated.node_manager_pb2")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert ray_compat.prestart_train_workers({"X": "1"}, 2, keep_alive_s=1) is False
    assert len(_compat_warnings(record)) == 1


def test_shutdown_order_fallback_is_rays_own_shutdown():
    """In a process of its own (the suite's cluster may be up in this one): a real local
    cluster, ``ray._private.worker`` absent, is shut down by Ray's own ``ray.shutdown()``."""
    code = textwrap.dedent("""
        import psutil, ray
        from raytrain import ray_compat
        real = ray_compat._internal
        ray_compat._internal = lambda module, name=None: (
            None if module == "ray._private.worker" else real(module, name))
        ray.init(num_cpus=1, include_dashboard=False, address="local")
        session = ray.get_runtime_context().gcs_address
        ray_compat.shutdown()
        assert not ray.is_initialized()
        left = [p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        print("shut down", session, "children left:", left)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "shut down" in proc.stdout, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("children left: []"), proc.stdout
