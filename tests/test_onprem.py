"""`ray up examples/cluster-onprem.yaml` for real: over SSH to this machine, a raytrain job on
the cluster it makes, then `ray down`.

    RAYTRAIN_ONPREM=1 .venv/bin/python -m pytest -q tests/test_onprem.py   # as root; .ci/run does

Opt-in (RAYTRAIN_ONPREM=1, skipped in the main suite) because it changes the machine: it
apt-installs openssh-server, rsync, netcat-openbsd and python3-venv when missing and creates
the Unix user `raytrain-onprem`. It takes about 2 minutes (more the first time: apt, and the
user's pip cache fills with the Ray wheel).

Real: Ray's cluster launcher (`ray up -y`, `ray exec`, `ray down -y`) with the `local` provider
talking OpenSSH and rsync to an sshd; the example's file_mounts (the repo, the token), its setup
commands (pip installs raytrain from the copied repo) and its start commands (`ray stop`, then
`ray start --head` with token auth and the dashboard on 127.0.0.1) run on the "node"; a
`ray job submit` of `python -m raytrain.fit` there; `ray down` running `ray stop` there.

Isolation (other engineers run Ray clusters as root on this machine at the same time):
- The node is this machine reached as the dedicated unprivileged user `raytrain-onprem`:
  `ray stop` (first start command, and what `ray down` runs) stops every Ray process *of the
  user it runs as*; as that user it cannot signal root's processes (EPERM), so no other
  cluster is touched. Runs of this test on one machine queue on a lock file (one user).
- A private sshd: 127.0.0.1, a free port, its own host key, config and authorized_keys in a
  temp dir; nothing is written to root's ~/.ssh (Ray's SSH runner passes the key with -i and
  UserKnownHostsFile=/dev/null).
- Ray's temp dir is the test's: RAY_TMPDIR for the node (in the user's ~/.bashrc) and for the
  launcher, so /tmp/ray (root's clusters, ray_current_cluster) is neither read nor written;
  every port `ray start --head` opens is set to one free now in 20000-32767 (below the
  kernel's ephemeral range, above Ray's default worker ports).
- What is left afterwards: no process of the user, no sshd or ssh client of the test; the user
  and its ~/.cache/pip stay for the next run.

The derived config (_derive) is the example with these changes only:
- cluster_name unique per run; provider head_ip 127.0.0.1, worker_ips [127.0.0.3] with
  min_workers = max_workers = 0: Ray never starts a worker node (a second node on this machine
  would run as the same user, and its `ray stop` would stop the head), but the head's
  `ray stop` function (the example's head_setup_commands) reaches 127.0.0.3 on port 22, where
  the private sshd also listens, and runs `ray stop` there, as on a worker: that checks its
  SSH path for real (here it stops the head's Ray itself: same user, same machine). Port 22,
  not the proxy: Ray leaves ssh_proxy_command out of the config it gives the head.
- auth: ssh_user raytrain-onprem, the test's key, ssh_proxy_command `nc %h PORT`: Ray's SSH
  runner has no port setting (command_runner.py passes only ProxyCommand through).
- file_mounts: the token file is the test's, not root's ~/.ray/auth_token.
- setup_commands: first, RAY_TMPDIR into ~/.bashrc. The venv command: a venv of the system
  python3 (same minor version as this venv's), `pip install --no-deps ray==<this Ray>` (real
  console scripts), then a .pth naming this venv's site-packages, so torch (5.5 GB with CUDA),
  torchvision and the rest are not downloaded again. The other setup commands are verbatim:
  `pip install -U pip`, `pip install -e ~/raytrain-src "ray[default,train,tune]==..."` (installs
  raytrain from the copied repo; finds every dependency satisfied), the ~/.bashrc line.
- head_start_ray_commands: the example's, with --port and --object-manager-port replaced and
  the other ports and a 200 MB object store added (a shared 2-core machine).
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import random
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import psutil
import pytest
import ray
import yaml

from tests.helpers import end_processes, metrics

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "cluster-onprem.yaml"
BIN = os.path.dirname(sys.executable)
USER = "raytrain-onprem"
LOCK = "/tmp/raytrain-onprem-test.lock"
CANARY = "--raytrain-onprem-canary"
# Listed as a worker that Ray never starts (min/max_workers 0), for the head's `ray stop`
# function (examples/cluster-onprem.yaml, head_setup_commands) to reach over SSH on port 22.
WORKER_IP = "127.0.0.3"
APT_PACKAGES = {"/usr/sbin/sshd": "openssh-server", "rsync": "rsync", "nc": "netcat-openbsd"}

pytestmark = pytest.mark.skipif(
    os.environ.get("RAYTRAIN_ONPREM") != "1",
    reason="opt-in: RAYTRAIN_ONPREM=1 (changes the machine: apt packages, a Unix user); "
    ".ci/run runs it after the main suite")


def _log(msg: str) -> None:
    print(f"[onprem {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- machine setup


def _apt_install() -> None:
    """openssh-server, rsync, netcat-openbsd, python3-venv: installed once, idempotent."""
    missing = sorted({pkg for tool, pkg in APT_PACKAGES.items() if not shutil.which(tool)})
    if not os.path.exists("/usr/bin/python3") or subprocess.run(
            ["/usr/bin/python3", "-c", "import ensurepip, venv"], capture_output=True).returncode:
        missing.append("python3-venv")  # and python3 with it
    if not missing:
        return
    if not shutil.which("apt-get"):
        pytest.skip(f"needs {' '.join(missing)} and there is no apt-get to install them")
    _log(f"apt-get install {' '.join(missing)}")
    # No service may start on install: a system sshd on port 22 is not ours to run.
    policy, added = Path("/usr/sbin/policy-rc.d"), False
    if not policy.exists():
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        added = True
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        lock = ["-o", "DPkg::Lock::Timeout=600"]
        for cmd in (["apt-get", *lock, "update", "-q"],
                    ["apt-get", *lock, "install", "-y", "-q", "--no-install-recommends",
                     *missing]):
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                pytest.skip(f"apt-get unavailable: {' '.join(cmd)} failed: "
                            f"{(out.stderr or out.stdout).strip()[-300:]}")
    finally:
        if added:
            policy.unlink()


def _python3() -> str:
    """The node's `python3` (the user's PATH): the same minor version as this venv's, because
    its venv reuses this venv's compiled packages (the same Python on every node)."""
    out = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == str(sys.version_info[:2]), (
        f"/usr/bin/python3 is {out.stdout.strip() or out.stderr}, this venv is "
        f"{sys.version_info[:2]}: the node's venv could not reuse this venv's packages")
    return "/usr/bin/python3"


def _user_processes(uid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real == uid:
                found.append(p)
        except psutil.Error:
            continue
    return found




def _fresh_user() -> pwd.struct_passwd:
    """The dedicated node account, as a fresh machine would have it (only ~/.cache kept)."""
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True)
        pw = pwd.getpwnam(USER)
    # Key-only login: '*' = no password, but not locked (sshd without PAM refuses "!" accounts).
    subprocess.run(["usermod", "--password", "*", USER], check=True)
    leftover = _user_processes(pw.pw_uid)  # a crashed earlier run of this test (we hold LOCK)
    if leftover:
        _log(f"ending {len(leftover)} processes left by an earlier run as {USER}")
        end_processes(leftover)
    home = Path(pw.pw_dir)
    for name in os.listdir(home):
        if name != ".cache":
            path = home / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for skel in Path("/etc/skel").iterdir():
        shutil.copy2(skel, home / skel.name)
        os.chown(home / skel.name, pw.pw_uid, pw.pw_gid)
    return pw


def _bindable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def _free_ports(n: int, block: int = 0) -> tuple[list[int], list[int]]:
    """n single free ports and one contiguous free block, all in 20000-32767."""
    rng = random.Random()
    taken: set[int] = set()
    while True:
        start = rng.randrange(20000, 32767 - block)
        span = range(start, start + block)
        if all(_bindable("", p) for p in span):
            taken.update(span)
            break
    singles = []
    while len(singles) < n:
        p = rng.randrange(20000, 32767)
        if p not in taken and _bindable("", p):
            taken.add(p)
            singles.append(p)
    return singles, list(span)


class Sshd:
    """A private sshd on 127.0.0.1:port (and on worker_ip:22 if given), everything it reads
    under ``base/ssh``."""

    def __init__(self, base: Path, user: str, worker_ip: str | None = None):
        self.dir = base / "ssh"
        self.dir.mkdir(mode=0o755)
        self.key = self.dir / "id_ed25519"
        host_key = self.dir / "host_ed25519"
        for path, comment in ((self.key, "raytrain-onprem-test"), (host_key, "host")):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                            "-f", str(path)], check=True)
        authorized = self.dir / "authorized_keys"
        authorized.write_text(self.key.with_suffix(".pub").read_text())
        authorized.chmod(0o644)  # sshd reads it as the user
        self.port = _free_ports(1)[0][0]
        config = self.dir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress 127.0.0.1:{self.port}",
            *([f"ListenAddress {worker_ip}:22"] if worker_ip else []), f"HostKey {host_key}",
            f"PidFile {self.dir}/sshd.pid", f"AuthorizedKeysFile {authorized}",
            f"AllowUsers {user}", "PermitRootLogin no", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
            # The key file sits under /tmp (mode 1777), which StrictModes refuses.
            "StrictModes no", "X11Forwarding no", "PrintMotd no", "MaxSessions 50",
            "MaxStartups 50:30:100", "Subsystem sftp internal-sftp", ""]))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        self.log = open(self.dir / "sshd.log", "w")
        self.proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, (self.dir / "sshd.log").read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            assert time.monotonic() < deadline, "sshd did not listen"
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """The listener and the per-connection sshd processes it forked."""
        try:
            return [self.ps, *self.ps.children(recursive=True)] if self.ps.is_running() else []
        except psutil.Error:
            return []

    def stop(self) -> None:
        end_processes(self.processes())
        self.proc.wait(timeout=10)
        self.log.close()


# ---------------------------------------------------------------------------- the config


def _derive(example: dict, *, cluster_name: str, sshd: Sshd, token: Path, node_tmp: Path,
            ports: dict[str, int], worker_ports: list[int], python3: str,
            worker_ip: str | None) -> dict:
    """The example with the changes listed in the module docstring, nothing else."""
    config = json.loads(json.dumps(example))  # deep copy
    config["cluster_name"] = cluster_name
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[worker_ip] if worker_ip else [])
    config["min_workers"] = config["max_workers"] = 0  # Ray starts no worker node
    config["auth"] = {"ssh_user": USER, "ssh_private_key": str(sshd.key),
                      "ssh_proxy_command": f"nc %h {sshd.port}"}
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    config["file_mounts"]["~/.ray/auth_token"] = str(token)

    setup = list(config["setup_commands"])
    venv = [i for i, c in enumerate(setup) if "python3 -m venv ~/venv" in c]
    assert len(venv) == 1, setup
    pyver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    deps = sysconfig.get_paths()["purelib"]  # this venv's site-packages
    setup[venv[0]:venv[0] + 1] = [
        f"test -x ~/venv/bin/pip || {python3} -m venv ~/venv",
        f"~/venv/bin/pip install -q --no-deps ray=={ray.__version__}",
        f"echo {shlex.quote(deps)} > ~/venv/lib/{pyver}/site-packages/zz-raytrain-test-deps.pth",
    ]
    bashrc = f"export RAY_TMPDIR={node_tmp}  # raytrain-onprem-test"
    setup.insert(0, f"sed -i '/raytrain-onprem-test/d' ~/.bashrc && "
                    f"echo {shlex.quote(bashrc)} >> ~/.bashrc")
    config["setup_commands"] = setup

    start = list(config["head_start_ray_commands"])
    shipped = start[-1]
    for flag in ("--port=6379", "--object-manager-port=8076"):
        assert flag in shipped, shipped
    shipped = shipped.replace("--port=6379", f"--port={ports['port']}").replace(
        "--object-manager-port=8076", f"--object-manager-port={ports['object_manager_port']}")
    extra = {k: v for k, v in ports.items() if k not in ("port", "object_manager_port")}
    extra.update(min_worker_port=worker_ports[0], max_worker_port=worker_ports[-1],
                 object_store_memory=200 * 2**20)
    start[-1] = shipped + "".join(f" --{k.replace('_', '-')}={v}" for k, v in extra.items())
    config["head_start_ray_commands"] = start
    return config


# ---------------------------------------------------------------------------- the test


class Launcher:
    """Runs `ray up/exec/down` as root from the repo root, as a user would on a laptop."""

    def __init__(self, base: Path, config_path: Path):
        self.config = str(config_path)
        tmp = base / "launcher"
        tmp.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(PATH=BIN + os.pathsep + env.get("PATH", ""), RAY_TMPDIR=str(tmp),
                   TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0")
        self.env = env

    def ray(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [os.path.join(BIN, "ray"), *args]
        _log(" ".join(shlex.quote(a) for a in cmd))
        t0 = time.monotonic()
        out = subprocess.run(cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout)
        _log(f"  exit {out.returncode} after {time.monotonic() - t0:.0f}s")
        return out

    def exec(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.ray("exec", self.config, command, timeout=timeout)


def _listening(port: int) -> list[tuple[str, int | None]]:
    return [(c.laddr.ip, c.pid) for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


@pytest.fixture
def machine():
    """Root, the packages, the node user, a temp dir, a private sshd; all undone after."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a Unix user and runs an sshd")
    _apt_install()
    python3 = _python3()
    with open(LOCK, "w") as lock:
        _log(f"waiting for {LOCK}")
        fcntl.flock(lock, fcntl.LOCK_EX)  # one run at a time: one user, one cluster
        pw = _fresh_user()
        base = Path(tempfile.mkdtemp(prefix="rt-op-", dir="/tmp"))  # short: unix sockets
        base.chmod(0o755)  # the user reaches authorized_keys and its own dir below
        node_tmp = base / "u"
        node_tmp.mkdir()
        os.chown(node_tmp, pw.pw_uid, pw.pw_gid)
        sshd = None
        # A root process `ray stop` matches as a Ray worker (its command line names
        # default_worker.py): the node user's `ray stop` must not be able to end it.
        canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)",
                                   "default_worker.py", CANARY], start_new_session=True)
        try:
            worker_ip = WORKER_IP if _bindable(WORKER_IP, 22) else None
            if not worker_ip:
                warnings.warn(f"{WORKER_IP}:22 is taken: the workers' part of `ray down` "
                              f"(head_setup_commands) is not exercised")
            sshd = Sshd(base, USER, worker_ip)
            yield dict(base=base, pw=pw, sshd=sshd, node_tmp=node_tmp, python3=python3,
                       canary=canary, worker_ip=worker_ip)
        finally:
            canary.kill()
            canary.wait()
            left = _user_processes(pw.pw_uid)
            if left:
                _log(f"cleanup: ending {len(left)} processes of {USER}")
                end_processes(left)
            if sshd:
                sshd.stop()
            end_processes(_launcher_processes(base))
            shutil.rmtree(base, ignore_errors=True)


def _launcher_processes(base: Path) -> list[psutil.Process]:
    """Root-side processes of this test's cluster: ssh clients (ControlPersist masters) and
    rsync, recognized by the test's key or config path on their command line."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(f"{base}/" in a for a in p.info["cmdline"] or ()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_ray_up_runs_raytrain_over_ssh_and_ray_down_stops_it(machine):
    t_start = time.monotonic()
    base, pw, sshd, node_tmp = (machine[k] for k in ("base", "pw", "sshd", "node_tmp"))
    token = base / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    names = ("port", "object_manager_port", "node_manager_port", "dashboard_port",
             "ray_client_server_port", "dashboard_agent_listen_port",
             "dashboard_agent_grpc_port", "runtime_env_agent_port", "metrics_export_port")
    singles, worker_ports = _free_ports(len(names), block=40)
    ports = dict(zip(names, singles))
    example = yaml.safe_load(EXAMPLE.read_text())
    config = _derive(example, cluster_name=f"raytrain-onprem-test-{base.name[6:]}", sshd=sshd,
                     token=token, node_tmp=node_tmp, ports=ports, worker_ports=worker_ports,
                     python3=machine["python3"], worker_ip=machine["worker_ip"])
    config_path = base / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    launcher = Launcher(base, config_path)
    home = Path(pw.pw_dir)
    runs = node_tmp / "runs"

    root_ssh = _snapshot(Path(pwd.getpwuid(0).pw_dir) / ".ssh")

    up = launcher.ray("up", "-y", "--no-config-cache", str(config_path), timeout=480)
    assert up.returncode == 0, up.stdout[-5000:]
    assert "Ray runtime started" in up.stdout, up.stdout[-3000:]
    # file_mounts: the repo (minus .gitignore'd) and the token, owned by the node's user.
    assert (home / "raytrain-src" / "pyproject.toml").read_bytes() == (REPO / "pyproject.toml"
                                                                    ).read_bytes()
    assert not (home / "raytrain-src" / ".venv").exists()
    assert (home / ".ray" / "auth_token").read_text() == token.read_text()
    assert (home / ".ray" / "auth_token").stat().st_mode & 0o777 == 0o600
    # Ray runs as the node user only, with the dashboard on the loopback.
    gcs = _listening(ports["port"])
    dashboard = _listening(ports["dashboard_port"])
    assert gcs and dashboard, (gcs, dashboard)
    assert {ip for ip, _ in dashboard} == {"127.0.0.1"}, dashboard
    for _, pid in gcs + dashboard:
        assert psutil.Process(pid).uids().real == pw.pw_uid

    # raytrain on the node is the copied repo, installed by the setup commands; from the home
    # directory too (the copy is ~/raytrain-src, so no ./raytrain shadows the package).
    where = launcher.exec("cd ~ && echo RAY-IS-A $(type -t ray) && python -c 'import raytrain, "
                          "ray; print(\"WHERE\", raytrain.__file__, ray.__version__)'")
    assert where.returncode == 0, where.stdout[-3000:]
    assert f"WHERE {home}/raytrain-src/raytrain/__init__.py {ray.__version__}" in where.stdout
    # head_setup_commands: the `ray stop` of `ray down` goes through the worker-stopping
    # function (no workers here: one host).
    assert "RAY-IS-A function" in where.stdout, where.stdout[-2000:]

    # Token auth is on: the CLI is refused without RAY_AUTH_MODE=token (set by ~/.bashrc).
    status = f"ray status --address 127.0.0.1:{ports['port']}"
    ok = launcher.exec(status, timeout=120)
    assert ok.returncode == 0 and "Node status" in ok.stdout, ok.stdout[-3000:]
    refused = launcher.exec(f"env -u RAY_AUTH_MODE {status}", timeout=180)
    assert refused.returncode != 0 and "InvalidAuthToken" in refused.stdout, \
        refused.stdout[-3000:]

    # The docs' workflow: `ray job submit` to the head's dashboard, raytrain as the job.
    job = launcher.exec(
        f"ray job submit --address http://127.0.0.1:{ports['dashboard_port']} -- "
        f"python -m raytrain.fit --num-workers 2 --dataset digits --epochs 1 "
        f"--storage-path {runs} --name onprem", timeout=420)
    assert job.returncode == 0, job.stdout[-5000:]
    assert "succeeded" in job.stdout, job.stdout[-3000:]
    rows = metrics(runs / "onprem")
    assert [r["epoch"] for r in rows] == [1]
    assert 0.0 <= rows[0]["test_acc"] <= 1.0 and (runs / "onprem" / "model.pt").exists()
    assert (runs / "onprem").stat().st_uid == pw.pw_uid  # written on the node, as its user

    down = launcher.ray("down", "-y", str(config_path), timeout=180)
    assert down.returncode == 0, down.stdout[-5000:]
    for line in down.stdout.splitlines():
        if re.search("ray stop on worker|Stopped all|Did not find", line):
            _log("  | " + re.sub(r"\x1b\[[0-9;]*m", "", line)[:150])
    _log(f"  | `ray stop` could not signal {down.stdout.count('Could not terminate')} processes "
         f"of other users (EPERM)")
    # Its `ray stop` tried to stop root's canary, a process it takes for a Ray worker, and could
    # not: no other Unix user's Ray process can be touched by it.
    worker_ip, canary = machine["worker_ip"], machine["canary"]
    if worker_ip:  # the head's function ran `ray stop` on the "worker" first, over SSH: as the
        # same user on the same machine, that stopped the head's Ray, so the head's own
        # `ray stop` then found nothing.
        stop_worker = down.stdout.find(f"ray stop on worker {worker_ip}")
        assert stop_worker >= 0, down.stdout[-3000:]
        assert f"ray stop on worker {worker_ip} failed" not in down.stdout
        assert re.search(r"Stopped all \d+ Ray processes", down.stdout[stop_worker:]), \
            down.stdout[-3000:]
        assert "Did not find any active Ray processes" in down.stdout[stop_worker:]
    assert re.search(rf"Could not terminate `[^`]*{CANARY}[^`]*` due to \(pid={canary.pid},",
                     down.stdout), down.stdout[-3000:]
    assert canary.poll() is None, "root's canary was stopped (by the node user's ray stop, " \
        "or by someone's `ray stop` as root)"
    # `ray down` ran `ray stop` on the node: no Ray process of the user is left.
    _wait_gone(lambda: [p for p in _user_processes(pw.pw_uid) if _name(p) != "sshd"], 20)
    # Its ssh sessions end when the launcher's ControlPersist masters time out (10 s).
    _wait_gone(lambda: _user_processes(pw.pw_uid), 40)
    assert not _listening(ports["port"]) and not _listening(ports["dashboard_port"])
    sshd.stop()
    assert not sshd.processes() and sshd.proc.returncode is not None
    _wait_gone(lambda: _launcher_processes(base), 30)
    assert _snapshot(Path(pwd.getpwuid(0).pw_dir) / ".ssh") == root_ssh  # root's ~/.ssh untouched
    _log(f"end to end {time.monotonic() - t_start:.0f}s")


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of every file below folder; {} if there is none."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in [folder, *folder.rglob("*")] if p.exists()}


def _wait_gone(find, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while found := find():
        assert time.monotonic() < deadline, [_cmd(p) for p in found]
        time.sleep(1)


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:200]
    except psutil.Error:
        return f"pid {p.pid} (gone)"
