"""Test helpers shared by the test files (fixtures live in conftest.py): data, processes, ports,
waits on real conditions, run files, file systems."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import pytest
import yaml

from raytrain.driver import cluster as driver_cluster
from raytrain.report import read_metrics


def write_tiny_cifar(root, n_per_batch: int = 20, n_test: int = 40, classes: int = 10,
                     seed: int = 0) -> str:
    """A tiny dataset in CIFAR-10's on-disk format (cifar-10-batches-py/ pickles).

    Images carry a learnable signal: the class sets the mean brightness of one channel.
    """
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)

    def batch(n: int) -> dict:
        labels = rng.integers(0, classes, n)
        images = rng.integers(0, 64, (n, 3, 32, 32)).astype(np.uint8)
        images[np.arange(n), labels % 3] += (labels * 19).astype(np.uint8)[:, None, None]
        return {"data": images.reshape(n, -1), "labels": labels.tolist(),
                "batch_label": "tiny"}

    for name in [f"data_batch_{i}" for i in range(1, 6)]:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch(n_per_batch), f)
    with open(os.path.join(folder, "test_batch"), "wb") as f:
        pickle.dump(batch(n_test), f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(classes)]}, f)
    return folder


def end_processes(procs: list[psutil.Process], grace_s: float = 10) -> None:
    """SIGTERM, wait ``grace_s``, then SIGKILL what is left (processes a test started)."""
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def fit_in_process(*argv: str) -> tuple[int, str, str]:
    """``raytrain.fit.main`` in this process (on the session's cluster): rc, stdout, stderr
    (also printed, for pytest's report of a failure)."""
    from raytrain import fit

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fit.main(list(argv))
    print(out.getvalue(), err.getvalue())
    return rc, out.getvalue(), err.getvalue()


def upload_folder(folder, bucket: str, prefix: str) -> str:
    """Copy ``folder``'s files into a new ``bucket`` of the session's S3 server (the
    ``s3_server`` fixture's environment) under ``prefix``; returns ``s3://bucket/prefix``."""
    import boto3

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket)
    for dirpath, _, names in os.walk(folder):
        for name in names:
            local = os.path.join(dirpath, name)
            s3.upload_file(local, bucket, f"{prefix}/{os.path.relpath(local, folder)}")
    return f"s3://{bucket}/{prefix}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports nothing listens on now, all bound at once: two ``free_port()``
    calls in a row can return the same port, just released (CI, 2026-12-06: a node's raylet
    and dashboard-agent ports, and `ray start` refused the pair)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


def checkpoint_dirs(run_dir) -> list[str]:
    """The run's checkpoint directories on disk, oldest first."""
    return sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint_epoch_"))


def metrics(run_dir) -> list[dict[str, Any]]:
    """The run's metrics.jsonl rows; [] before the first epoch."""
    return read_metrics(str(run_dir))


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               proc: subprocess.Popen | None = None, interval: float = 0.1) -> Any:
    """Poll ``condition`` until it is truthy (returned) or ``timeout`` s pass (an assertion
    naming ``what``); a ``proc`` that exits meanwhile fails at once with its output."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(interval)


def wait_for_epoch(run_dir, epoch: int, proc, timeout: float = 180) -> None:
    wait_until(lambda: any(r["epoch"] >= epoch for r in metrics(run_dir)), timeout,
               f"epoch {epoch} reported", proc)


def job_processes(job_id: str, env_vars: dict[str, str]) -> set[int]:
    """PIDs of this machine's Ray worker processes of job ``job_id`` (hex) whose environment
    has ``env_vars`` (named ``ray::IDLE``, ``ray::RayTrainWorker``... once registered)."""
    want = {f"{k}={v}" for k, v in env_vars.items()} | {f"RAY_JOB_ID={job_id}"}
    found = set()
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if (cmd.startswith("ray::") or "default_worker.py" in cmd) and want <= {
                    f"{k}={v}" for k, v in p.environ().items()}:
                found.add(p.pid)
        except psutil.Error:  # gone, or not ours to read
            continue
    return found


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until ``procs`` have exited (zombies count as gone); returns those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


@contextlib.contextmanager
def small_tmpfs(path, size: str, options: str = ""):
    """A real file system of ``size`` at ``path`` (needs root: this machine and CI have it)."""
    os.makedirs(path)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()[:120]}): a real full "
                    "disk needs mount permission (root)")
    try:
        yield path
    finally:  # lazily if a Ray process still holds a file open in it
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


@contextlib.contextmanager
def read_only_dir(path):
    """A directory nobody can write to, root included: a read-only tmpfs as root, else mode
    0500 (which root would ignore)."""
    if os.geteuid() == 0:
        with small_tmpfs(path, "1m", ",ro") as mounted:
            yield mounted
        return
    os.makedirs(path)
    os.chmod(path, 0o500)
    try:
        yield path
    finally:
        os.chmod(path, 0o700)


# ---------------------------------------------------------------------------- Ray clusters


REPO = Path(__file__).resolve().parents[1]
AWS = REPO / "cluster.yaml"
ONPREM = REPO / "examples" / "cluster-onprem.yaml"
BIN = os.path.dirname(sys.executable)


def raw_config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def start_parts(command: str) -> tuple[dict[str, str], list[str]]:
    """(variables exported, `ray start` argv) of ``... && export K=V && ray start ...``."""
    env: dict[str, str] = {}
    argv: list[str] = []
    for part in command.split("&&"):
        words = shlex.split(part.strip())
        if words[:1] == ["export"]:
            env.update(word.split("=", 1) for word in words[1:])
        elif words[:2] == ["ray", "start"]:
            argv = words
    return env, argv


# Run with the cluster's env: alive and dead nodes (ray.nodes()) and Ray Train worker actors,
# alive or finished, with the node each ran on (Ray's state API).
PROBE = """
import json, sys, ray
from ray.util.state import list_actors
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
actors = list_actors(address=sys.argv[1], filters=[("class_name", "=", "RayTrainWorker")],
                     limit=10000, raise_on_missing_output=False)
print("PROBE " + json.dumps({"nodes": ray.nodes(), "workers": [
    {"id": a.actor_id, "node_id": a.node_id, "pid": a.pid} for a in actors]}))
"""


# `ray start` records its cluster's address in <temp dir>/ray_current_cluster (Ray 2.60
# _common/utils.get_ray_address_file; /tmp/ray without --temp-dir). A bare ray.init() and
# Ray's own processes (the State API) connect to whatever /tmp/ray's copy names, so a test
# must leave that file as it found it (DESIGN.md). LocalCluster passes --temp-dir, so its
# copy is written under its own directory; AddressFileGuard checks /tmp/ray's is untouched.
DEFAULT_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")


class AddressFileGuard:
    """What /tmp/ray/ray_current_cluster held (its text, or None: absent) when made;
    ``restore`` puts it back only where our cluster's address replaced it:
    another agent's cluster may rewrite it meanwhile, and that is theirs to keep."""

    def __init__(self, path: Path = DEFAULT_ADDRESS_FILE):
        self.path = path
        self.before = self._read()

    def _read(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    def restore(self, port: int) -> bool:
        """Put the file back as it was if it now names a cluster at ``port`` (ours: the port
        is free on this machine only while our head is not); True if it did."""
        now = self._read()
        if now == self.before or (now or "").strip().rpartition(":")[2] != str(port):
            return False
        if self.before is None:
            self.path.unlink(missing_ok=True)
        else:
            self.path.write_text(self.before)
        return True


NODE_START_TIMEOUT = "The current node timed out during startup"  # ray/_private/node.py


class LocalCluster:
    """Ray nodes started here with `ray start`, each in a process session of its own."""

    def __init__(self):
        # Short: Ray puts unix sockets under the temp dir (108-byte path limit).
        self.base = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
        self.sessions: list[int] = []
        token = self.base / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        config = raw_config(AWS)
        self.head_env, self.head_argv = start_parts(config["head_start_ray_commands"][-1])
        self.node_env, self.node_argv = start_parts(config["worker_start_ray_commands"][-1])
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(driver_cluster.CONTROLLER_ENV, PATH=BIN + os.pathsep + env.get("PATH", ""),
                   RAY_AUTH_TOKEN_PATH=str(token))  # this cluster's token, not ~/.ray's
        self.env = env
        self.client_env = {**env, "RAY_AUTH_MODE": "token"}  # as docs/cluster.md says
        # The head's ports, drawn at once (free_ports); its `ray start` takes them all.
        self.port, self.dashboard_port, *self._head_ports = free_ports(5, "")
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.node_ports: dict[int, int] = {}  # session id -> the node's raylet port
        self.address_file = AddressFileGuard()

    # The GCS marks a node dead after this many failed health checks this far apart (Ray 2.60
    # defaults: 5 x 3 s). A test's lost node is SIGKILLed: every check fails at once, so the
    # shorter period only shortens the wait (a loaded machine's slow answer still has the
    # default 10 s timeout per check).
    HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000",
                     "RAY_health_check_failure_threshold": "3"}

    def start_head(self) -> int:
        agent, client, raylet = self._head_ports
        return self._start(self.head_argv, {**self.head_env, **self.HEALTH_CHECKS}, port=self.port,
                           dashboard_port=self.dashboard_port, include_dashboard="true",
                           ray_client_server_port=client, dashboard_agent_listen_port=agent,
                           node_manager_port=raylet)

    def add_node(self, **flags) -> int:
        """Start one more node joining the head; returns its session id (see stop_session)."""
        raylet, agent = free_ports(2, "")
        port = flags.setdefault("node_manager_port", raylet)
        flags.setdefault("dashboard_agent_listen_port", agent)
        # A temp dir of its own, as on another machine: nodes sharing one session directory share
        # its runtime_resources, and one node's runtime-env agent removing or re-unpacking a
        # job's working_dir there took files from under the running driver (Ray 2.60
        # packaging.py rmtree; CI: "No module named 'raytrain.driver.placement'").
        flags.setdefault("temp_dir", self.base / f"node-{port}")
        session = self._start(self.node_argv, self.node_env, address=self.address, **flags)
        self.node_ports[session] = port
        return session

    def node_id(self, session: int) -> str:
        """The Ray node id of the node ``add_node`` started in ``session`` (by its raylet port)."""
        port = self.node_ports[session]
        return next(n["NodeID"] for n in self.probe()["nodes"]
                    if n["Alive"] and n["NodeManagerPort"] == port)

    def running(self, session: int) -> bool:
        """Whether any process of ``session`` (a node ``add_node`` started) still runs."""
        return bool(self._session_processes(session))

    def _session_processes(self, session: int) -> list[psutil.Process]:
        found = []
        for p in self._ours({session}):
            try:
                if os.getsid(p.pid) == session:
                    found.append(p)
            except OSError:  # gone meanwhile
                continue
        return found

    def train_workers(self, session: int) -> list[psutil.Process]:
        """The Ray Train worker processes (``ray::RayTrainWorker...``) of the node started in
        ``session``, alive now."""
        found = []
        for p in self._session_processes(session):
            try:
                if " ".join(p.cmdline()).startswith("ray::RayTrainWorker"):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def kill_node(self, session: int) -> list[psutil.Process]:
        """SIGKILL every process of the node started in ``session`` at once (its raylet, agents
        and the workers it started), as a reclaimed instance loses them; returns them, gone."""
        victims = self._session_processes(session)
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=10)
        return victims

    def _start(self, argv: list[str], exports: dict[str, str], **flags) -> int:
        flags = {"num_cpus": 1, "object_store_memory": 200 * 2**20, "temp_dir": self.base / "ray",
                 **flags}
        machine_bound = ("--port=", "--address=", "--object-manager-port=", "--autoscaling-config=")
        cmd = [shutil.which("ray", path=BIN)]
        cmd += [a for a in argv[1:] if not a.startswith(machine_bound)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
        for attempt in range(1, self.START_TRIES + 1):
            proc = subprocess.Popen(cmd, env={**self.env, **exports}, start_new_session=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.sessions.append(proc.pid)  # the daemons it leaves behind keep this session id
            out, _ = proc.communicate(timeout=120)
            if proc.returncode == 0:
                return proc.pid
            # `ray start` gives its raylet 30 s to show in the GCS (node.py, not configurable),
            # and the raylet registers only once its agents, Python processes, have written
            # their port files. It waits 15 s for the dashboard agent's, then aborts (Ray 2.60
            # node_manager.cc:3576, "Check failed ... Timed out waiting for file
            # .../metrics_agent_port_<node id>"; not configurable). That agent's imports took
            # 8 s on a normal suite run here and more than 15 s on a loaded one (CI 2026-12-07:
            # the added node's raylet died so, the run waiting for it gave up). Reproduced with
            # the agent delayed 40 s: the same abort, the same stack. A raylet still waiting
            # when `ray start` gives up is waited for; one that died is started again.
            timed_out = NODE_START_TIMEOUT in out
            if timed_out and self._registers(proc.pid, flags["node_manager_port"]):
                return proc.pid
            log = self._raylet_log(Path(flags["temp_dir"]))
            self.stop_session(proc.pid)
            if not timed_out or attempt == self.START_TRIES:
                raise AssertionError(f"{out[-3000:]}\n--- raylet.out, last lines ---\n{log}")

    START_TRIES = 3  # a start's slow agent is the machine's load of the moment

    def _registers(self, session: int, port: int, timeout: float = 150) -> bool:
        """Whether the raylet of ``session`` (listening on ``port``) joins the cluster within
        ``timeout`` s; False as soon as it has died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not any(p.name() == "raylet" for p in self._session_processes(session)):
                    return False
                if any(n["Alive"] and n["NodeManagerPort"] == port
                       for n in self.probe()["nodes"]):
                    return True
            except (psutil.Error, AssertionError, subprocess.TimeoutExpired):
                pass  # a process gone meanwhile, or a GCS not answering yet: look again
            time.sleep(2)
        return False

    @staticmethod
    def _raylet_log(temp_dir: Path, lines: int = 40) -> str:
        """The last start's raylet.out under ``temp_dir``: its failed checks (the reason a
        raylet aborted; its stack trace follows them) and its last lines."""
        log = temp_dir / "session_latest" / "logs" / "raylet.out"
        text = log.read_text(errors="replace").splitlines() if log.exists() else ["(none)"]
        return "\n".join([ln for ln in text if "Check failed" in ln] + text[-lines:])

    def run(self, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.client_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)

    def probe(self) -> dict:
        out = self.run([sys.executable, "-c", PROBE, self.address], timeout=120)
        assert out.returncode == 0, out.stdout[-3000:]
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")][-1]
        return json.loads(line.removeprefix("PROBE "))

    def _ours(self, sessions: set[int]) -> list[psutil.Process]:
        """Processes in the given sessions, or (job drivers Ray starts in new sessions) whose
        command line names this cluster's own directory."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.pid != os.getpid() and (os.getsid(p.pid) in sessions or any(
                        f"{self.base}/" in arg for arg in p.info["cmdline"] or ())):
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        return found

    def stop_session(self, session: int) -> None:
        end_processes([p for p in self._ours({session}) if os.getsid(p.pid) == session])

    def stop(self) -> None:
        # The whole test cluster goes: what ignores SIGTERM for 3 s is killed (10 s of grace
        # here was 10 s of every module's teardown).
        end_processes(self._ours(set(self.sessions)), grace_s=3)
        shutil.rmtree(self.base, ignore_errors=True)
        restored = self.address_file.restore(self.port)
        assert not restored, f"{DEFAULT_ADDRESS_FILE} named this test's cluster (now put back)"
