"""`ray up` configs, multi-node runs and `ray job submit`, on real Ray processes (no mocks).

    .venv/bin/python -m pytest -q tests/test_cluster.py

The configs are checked with the same prepare + validate `ray up` runs before it launches
anything. The live cluster is started with `ray start` using the start commands of cluster.yaml
(their exported env and flags; ports, CPUs and temp dir made to fit one machine) and a private
auth token, and is stopped by ending exactly the process sessions it started: never `ray stop`,
which would stop every Ray cluster on the machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.autoscaler._private.util import prepare_config, validate_config

from raytrain.driver.preflight import check_storage_for_multinode
from raytrain.config import RaytrainError
from tests.helpers import AWS, BIN, ONPREM, REPO, LocalCluster, metrics
from tests.helpers import raw_config as _raw, start_parts as _start_parts

CONFIGS = pytest.mark.parametrize("path", [AWS, ONPREM], ids=["aws", "onprem"])
# What the on-prem config must share with cluster.yaml, word for word (initialization_commands
# and head_setup_commands are for site-specific steps: storage mounts, boto3 on an AWS head).
SHARED = ("file_mounts", "rsync_filter", "rsync_exclude", "setup_commands",
          "head_start_ray_commands", "worker_start_ray_commands")


def _prepared(path: Path) -> dict:
    """The config as `ray up` has it before launching: defaults filled, then validated."""
    config = prepare_config(_raw(path))
    validate_config(config)
    return config


# ---------------------------------------------------------------------------- configs


@CONFIGS
def test_config_passes_rays_own_validation(path):
    config = _prepared(path)
    assert config["head_node_type"] in config["available_node_types"]


def test_aws_config_has_a_cpu_head_and_gpu_workers_added_on_demand():
    config = _prepared(AWS)
    assert config["provider"]["type"] == "aws" and config["provider"]["region"] == "us-west-2"
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("CPU", 0) > 0 and head["resources"].get("GPU", 0) == 0
    gpu = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert {t["resources"]["GPU"] for t in gpu.values()} >= {1, 8}
    for name, t in gpu.items():  # none kept idle; the autoscaler adds them when asked
        assert t["min_workers"] == 0 < t["max_workers"] <= config["max_workers"], name
    for t in types.values():
        assert t["node_config"]["InstanceType"] and t["node_config"]["ImageId"]
    # No ingress of our own: Ray's default group allows SSH and the cluster's own nodes only.
    assert config["provider"]["security_group"]["IpPermissions"] == []


@CONFIGS
def test_every_node_installs_raytrain_and_starts_ray_with_token_auth(path):
    config = _prepared(path)
    mounts = config["file_mounts"]
    assert mounts["~/.ray/auth_token"] == "~/.ray/auth_token"
    source = REPO / mounts["~/raytrain-src"]  # relative to the repo root, where `ray up` runs
    assert 'name = "raytrain"' in (source / "pyproject.toml").read_text()
    for key in ("head_setup_commands", "worker_setup_commands"):  # setup_commands merged in
        installs = [c for c in config[key] if "pip install" in c and "-e ~/raytrain-src" in c]
        assert installs, key
        assert f"ray[default,train,tune]=={ray.__version__}" in installs[0], (
            f"{path.name} pins another Ray than this one ({ray.__version__}): keep them equal")
    head_env, head = _start_parts(config["head_start_ray_commands"][-1])
    worker_env, worker = _start_parts(config["worker_start_ray_commands"][-1])
    for env in (head_env, worker_env):
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_TRAIN_ENABLE_STATE_TRACKING"] == "1"
    assert "--head" in head and "--dashboard-host=127.0.0.1" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    assert any(arg.startswith("--address=$RAY_HEAD_IP:") for arg in worker)


def test_onprem_config_shares_every_command_with_the_aws_one():
    aws, onprem = _raw(AWS), _raw(ONPREM)
    for key in SHARED:
        assert onprem[key] == aws[key], f"{key} differs between {AWS.name} and {ONPREM.name}"
    assert onprem["provider"]["type"] == "local"
    assert onprem["provider"]["head_ip"] and onprem["provider"]["worker_ips"]
    assert onprem["auth"]["ssh_user"] and onprem["auth"]["ssh_private_key"]


# ---------------------------------------------------------------------------- a live cluster


@pytest.fixture(scope="module")
def two_nodes():
    """A head and one more node, 1 CPU each, on this machine; token auth on."""
    cluster = LocalCluster()
    try:
        cluster.start_head()
        cluster.add_node()
        yield cluster
    finally:
        cluster.stop()


def test_cli_reaches_the_cluster_only_with_ray_auth_mode_token(two_nodes):
    # Why every start command in the configs exports RAY_AUTH_MODE=token: the token alone
    # (here in RAY_AUTH_TOKEN_PATH, on a cluster in ~/.ray/auth_token) is not sent without it.
    status = [shutil.which("ray", path=BIN), "status", "--address", two_nodes.address]
    deadline = time.monotonic() + 60  # the autoscaler report lags a fresh head by seconds
    while True:
        ok = two_nodes.run(status, timeout=120)
        assert ok.returncode == 0, ok.stdout[-3000:]
        if "Node status" in ok.stdout or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "Node status" in ok.stdout
    env = {k: v for k, v in two_nodes.client_env.items() if k != "RAY_AUTH_MODE"}
    refused = subprocess.run(status, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "InvalidAuthToken" in refused.stdout


def test_fit_runs_one_worker_on_each_of_two_nodes(two_nodes):
    before = two_nodes.probe()
    nodes = [n for n in before["nodes"] if n["Alive"]]
    assert len(nodes) == 2
    assert len({n["NodeManagerAddress"] for n in nodes}) == 1  # two nodes, one host
    storage = two_nodes.base / "runs"
    check_storage_for_multinode(str(storage), nodes, shared=False)  # one host: a local path is fine
    out = two_nodes.run([sys.executable, "-m", "raytrain.fit", "--num-workers", "2",
                         "--dataset", "digits", "--epochs", "2", "--address", two_nodes.address,
                         "--storage-path", str(storage), "--name", "x"])
    assert out.returncode == 0, out.stdout[-3000:]
    assert [r["epoch"] for r in metrics(storage / "x")] == [1, 2]
    seen = {w["id"] for w in before["workers"]}
    workers = [w for w in two_nodes.probe()["workers"] if w["id"] not in seen]
    assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
    assert {w["node_id"] for w in workers} == {n["NodeID"] for n in nodes}  # one on each node


def test_ray_job_submit_runs_raytrain_and_returns_its_exit_status(two_nodes):
    ray_cli = shutil.which("ray", path=BIN)
    storage = two_nodes.base / "jobs"
    submit = [ray_cli, "job", "submit", "--address", two_nodes.dashboard, "--working-dir",
              str(REPO), "--", "python", "-m", "raytrain.fit"]
    ok = two_nodes.run(submit[:-2] + ["-X", "importtime"] + submit[-2:] + [
        "--num-workers", "1", "--dataset", "digits", "--epochs", "1", "--storage-path",
        str(storage), "--name", "job"])
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "succeeded" in ok.stdout
    assert [r["epoch"] for r in metrics(storage / "job")] == [1], ok.stdout[-3000:]
    # The driver imports no torch (model.pt is rank 0's, driver/run.py export_model): none is
    # loaded after ray.init in a `ray job submit` driver, where torch's static TLS failed.
    assert "| ray.train" in ok.stdout and not re.search(r"\| +torch$", ok.stdout, re.M)
    assert (storage / "job" / "model.pt").stat().st_size > 0
    bad = two_nodes.run(submit + ["--num-workers", "0"], timeout=180)  # raytrain exits 2
    assert bad.returncode != 0
    assert "--num-workers: got '0'" in bad.stdout and "exit code 2" in bad.stdout


def test_storage_check_refuses_a_local_path_on_two_hosts(two_nodes):
    # This machine is the only host to be had, so the second host is a Ray node started on the
    # second loopback address, 127.0.0.2: Ray records it as another NodeManagerAddress, which
    # is what the check reads. The node list is ray.nodes() as it comes, nothing edited.
    session = two_nodes.add_node(node_ip_address="127.0.0.2", num_cpus=0)
    try:
        nodes = [n for n in two_nodes.probe()["nodes"] if n["Alive"]]
    finally:
        two_nodes.stop_session(session)
    hosts = {n["NodeManagerAddress"] for n in nodes}
    assert len(nodes) == 3 and len(hosts) == 2 and "127.0.0.2" in hosts
    with pytest.raises(RaytrainError) as err:
        check_storage_for_multinode("/x/runs", nodes, shared=False)
    assert str(err.value) == (
        "--storage-path /x/runs: node-local disk, but the workers may run on 3 nodes on 2 hosts; "
        "use shared storage (an EFS/NFS mount) or pass --shared-storage if this path is "
        "shared")
    with pytest.raises(RaytrainError):
        check_storage_for_multinode("file:///x/runs", nodes, shared=False)
    for remote in ("s3://bucket/runs", "gs://bucket/runs"):
        check_storage_for_multinode(remote, nodes, shared=False)
    check_storage_for_multinode("/mnt/nfs/runs", nodes, shared=True)
    # Once the second host's node has stopped, ray.nodes() still lists it, as not Alive.
    deadline = time.monotonic() + 60
    while True:
        after = two_nodes.probe()["nodes"]
        if not any(n["Alive"] and n["NodeManagerAddress"] == "127.0.0.2" for n in after):
            break
        assert time.monotonic() < deadline, "the stopped node never showed as dead"
        time.sleep(1)
    assert len(after) == 3
    check_storage_for_multinode("/x/runs", after, shared=False)
