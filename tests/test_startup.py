"""Fixed costs of a run (issue #27): a cluster raytrain starts knows its own address, so no
process of it follows a stale /tmp/ray address file (tests/test_robustness.py shows the run
that then ended 40 s late); the workers import torch from their process start, which the
driver has Ray begin before the controller exists. The measured times are
benchmarks/launcher_overhead.py's; this checks the mechanisms, not a time."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import job_processes, wait_until

# A new cluster from ray_compat.init_local, in its own process.
PROBE = textwrap.dedent("""
    import json, os, sys, time, urllib.error, urllib.request
    from raytrain import ray_compat
    if sys.argv[1] == "ray-order":  # the DASHBOARD_BESIDE_RAYLET fallback: Ray's own order
        ray_compat._node_class = lambda: None
    before = dict(os.environ)
    ctx = ray_compat.init_local(logging_level="ERROR", num_cpus=2)
    import ray

    @ray.remote(num_cpus=1)
    class Probe:
        def address(self):
            return os.environ.get("RAY_ADDRESS")

    @ray.remote(num_cpus=0)
    def task():
        return os.environ.get("RAY_ADDRESS"), os.environ.get("RAY_GCS_SERVER_PORT")

    out = {"gcs": ctx.address_info["gcs_address"], "driver": os.environ.get("RAY_ADDRESS"),
           "driver_port": os.environ.get("RAY_GCS_SERVER_PORT"),
           "actor": ray.get(Probe.remote().address.remote()), "task": ray.get(task.remote())}
    try:  # after the tasks above: the thread that started the dashboard has long returned
        urllib.request.urlopen(f"http://{ctx.dashboard_url}/api/version", timeout=10)
        out["dashboard"] = 200
    except urllib.error.HTTPError as err:  # token auth on: it answers, and refuses us
        out["dashboard"] = err.code
    except OSError as err:
        out["dashboard"] = str(err)
    ray_compat.shutdown()
    mine = ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT")  # ray.init sets others (RAY_AUTH_MODE...)
    out["restored"] = all(os.environ.get(k) == before.get(k) for k in mine)
    print(json.dumps(out))
""")


@pytest.mark.parametrize("order", ["beside", "ray-order"])
def test_a_new_cluster_and_every_process_it_starts_know_its_address(order):
    """...and its dashboard, started beside its raylet (ray_compat.DASHBOARD_BESIDE_RAYLET) or,
    where this Ray lacks that, before it, is up and answers once ray.init returns (started from
    a thread, it was killed with the thread at first: Ray's fate sharing)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True,
                          timeout=240, env={k: v for k, v in __import__("os").environ.items()
                                            if k != "RAY_ADDRESS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dashboard"] in (200, 401), out["dashboard"]
    assert out["driver"] == out["gcs"]  # not what /tmp/ray/ray_current_cluster says
    assert out["actor"] == out["gcs"]  # every process Ray starts inherits it
    assert out["task"][0] == out["gcs"]
    # the GCS port is read once, at start: a cluster the driver's child starts must not take it
    assert out["driver_port"] is None
    assert out["restored"]  # the driver's environment as it was before the cluster



def _imported_at_start(out: str):
    """A train function: what this worker process had imported when Ray Train called it."""
    def train_fn(config):
        import sys

        with open(out, "w") as f:
            json.dump({m: m in sys.modules for m in ("torch._dynamo", "raytrain.worker.loop")}, f)
    return train_fn


def test_train_workers_import_torch_from_their_start(ray_cluster, tmp_path):
    """The setup hook (worker/warm.py) runs in every Train worker process before Ray Train
    calls it: the torch._dynamo import (DDP's and the optimizer's constructors), which
    nothing before the train function needs, is done by then. Without the hook
    (the control run) it is not."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain import ray_compat
    from raytrain.worker import warm

    env = ray_compat.setup_hook_env(warm.HOOK)
    assert env, "this Ray lacks the setup hook's env var"
    seen = {}
    for name, worker_env in (("warm", {"env_vars": env}), ("control", None)):
        out = str(tmp_path / f"{name}.json")
        result = TorchTrainer(_imported_at_start(out), scaling_config=ScalingConfig(num_workers=1),
                              run_config=RunConfig(storage_path=str(tmp_path), name=name,
                                                   worker_runtime_env=worker_env)).fit()
        assert result.error is None
        with open(out) as f:
            seen[name] = json.load(f)
    assert seen["warm"] == {"torch._dynamo": True, "raytrain.worker.loop": True}
    assert seen["control"]["torch._dynamo"] is False


# What a Train controller unpickles, and what a Tune trial's process imports to build its
# trainer (raytrain.tune.trial, the Trainer class, the workers' entry point): no torch.
NO_TORCH = textwrap.dedent("""
    import pickle, sys
    from raytrain import ray_compat
    classes = ray_compat._trainer_classes()
    pickle.loads(pickle.dumps([classes["TorchBackendConfig"](backend="gloo"),
                               classes["TorchBackend"](), classes["ClusterPolicy"]]))
    controller = "torch" in sys.modules
    import raytrain.tune.trial, raytrain.worker.ray_entry
    ray_compat._trainer_class()
    print(controller, "torch" in sys.modules)
""")


def _allreduce_then_report():
    """A train function (nested: pickled by value, the workers cannot import tests/): each
    rank all-reduces its rank + 1 and reports an epoch's metrics row with the sum, the world
    and torch's version (which the controller unpickles)."""
    def train_fn(config):
        import ray.train
        import torch
        import torch.distributed as dist

        from raytrain import report

        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        ray.train.report({**dict.fromkeys(report.METRICS, 1.0), "sum": total.item(),
                          "world": dist.get_world_size(), "backend": dist.get_backend(),
                          "version": torch.__version__})
    return train_fn


def test_the_train_controller_never_imports_torch(ray_cluster, tmp_path):
    """Ray's TorchConfig made every run's (and Tune trial's) controller import torch, 2-3 s of
    CPU before its workers start; ray_compat.TorchBackendConfig forms the same gloo group
    without it, and a worker sends torch's version as a str (worker/warm.py): the controller
    unpickles the report with torch still unloaded (asked from inside it by a callback). A
    Tune trial's process, which builds a trainer and waits, imports no torch either."""
    from ray.train import RunConfig, ScalingConfig, UserCallback

    from raytrain import ray_compat
    from raytrain.driver import run as driver_run
    from raytrain.worker import warm

    out = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]

    seen = tmp_path / "controller.json"

    class Seen(UserCallback):  # defined here: pickled by value into the controller
        def after_report(self, run_context, metrics, checkpoint):
            import sys

            seen.write_text(json.dumps({  # each rank's report, torch's version's type
                "torch": "torch" in sys.modules, "reports": [
                    {k: m[k] for k in ("sum", "world", "backend")} | {
                        "version": type(m["version"]).__name__} for m in metrics]}))

    result = ray_compat.make_trainer(
        _allreduce_then_report(), fixed_cluster=False, driver_outlives_run=True,
        scaling_config=ScalingConfig(num_workers=2),
        # raytrain's own run-files callback first: it writes TensorBoard's events (tensorboardX)
        run_config=RunConfig(storage_path=str(tmp_path), name="notorch", callbacks=[
            driver_run.RunFiles(str(tmp_path / "notorch")), Seen()],
                             worker_runtime_env={"env_vars": ray_compat.setup_hook_env(
                                 warm.HOOK)})).fit()
    assert result.error is None
    rank = {"sum": 3.0, "world": 2, "backend": "gloo", "version": "str"}  # a 2-rank gloo group
    assert json.loads(seen.read_text()) == {"torch": False, "reports": [rank, rank]}
    assert list((tmp_path / "notorch" / "tensorboard").iterdir())  # events written


def _write_pid(out_dir: str):
    """A train function: each rank writes its process's PID."""
    def train_fn(config):
        import os

        import ray.train

        rank = ray.train.get_context().get_world_rank()
        with open(os.path.join(out_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    return train_fn


def test_prestarted_processes_become_the_runs_train_workers(ray_cluster, tmp_path):
    """driver.cluster.prestart_workers has this node's raylet start the workers' processes
    before the controller exists (they import torch meanwhile, worker/warm.py). The raylet
    gives an actor an idle process only if their runtime envs serialise to the same string
    (ray_compat.prestart_train_workers rebuilds the one Ray Train's controller gives its
    workers): the run's two workers are exactly the two processes started here, and none
    is left over."""
    import ray
    from ray.train import RunConfig, ScalingConfig

    from raytrain import ray_compat
    from raytrain.driver import cluster

    job, env = ray.get_runtime_context().get_job_id(), cluster.worker_env()
    before = job_processes(job, env)
    cluster.prestart_workers(2)

    def two_new() -> set[int]:
        new = job_processes(job, env) - before
        return new if len(new) == 2 else set()

    started = wait_until(two_new, 30, "two processes started")
    result = ray_compat.make_trainer(
        _write_pid(str(tmp_path)), fixed_cluster=False, driver_outlives_run=True,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="prestarted",
                             worker_runtime_env={"env_vars": env})).fit()
    assert result.error is None
    ranks = {int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)}
    assert ranks == started, (ranks, started)
    # an unused one would idle on until its keep-alive ends; the workers' exit at the run's end
    wait_until(lambda: not job_processes(job, env) - before, 30, "the workers' processes gone")
