"""Monitoring against a `ray start --head` cluster: the dashboard's Train API lists the run,
Prometheus serves raytrain's gauges, the run writes plots and TensorBoard events, and the
console shows one progress line per epoch and no Ray tracebacks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
import pytest

from tests.helpers import free_ports

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _get(url: str, token: str | None) -> str:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def head():
    """A head started the way users do; only its own processes are stopped afterwards."""
    temp = tempfile.mkdtemp(prefix="rtmon", dir="/tmp")
    ports = dict(zip(("port", "dashboard", "metrics"), free_ports(3)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_TRAIN_ENABLE_STATE_TRACKING")}
    env["RAY_AUTH_MODE"] = "token" if os.path.exists(os.path.expanduser("~/.ray/auth_token")) \
        else env.get("RAY_AUTH_MODE", "")
    # Ray's processes report metrics every 10 s by default: a run had to last 30 s to be seen
    env["RAY_metrics_report_interval_ms"] = "1000"
    subprocess.run([RAY, "start", "--head", f"--port={ports['port']}", "--num-cpus=2",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={ports['dashboard']}",
                    f"--metrics-export-port={ports['metrics']}", f"--temp-dir={temp}",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True,
                   timeout=120)
    yield ports
    procs = [p for p in psutil.process_iter(["cmdline"])
             if temp in " ".join(p.info["cmdline"] or [])]
    for p in procs + [c for p in procs for c in p.children(recursive=True)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    shutil.rmtree(temp, ignore_errors=True)


def test_run_is_visible_in_dashboard_prometheus_and_files(head, tmp_path):
    token_file = os.path.expanduser("~/.ray/auth_token")
    token = open(token_file).read().strip() if os.path.exists(token_file) else None
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_TRAIN_ENABLE_STATE_TRACKING")}
    proc = subprocess.Popen([sys.executable, "-m", "raytrain.fit", "--address",
                             f"127.0.0.1:{head['port']}", "--num-workers", "2", "--dataset",
                             "synthetic", "--synthetic-size", "4800", "--epochs", "3",
                             "--storage-path", str(tmp_path), "--name", "mon"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    prometheus = ""
    # gauges live while the workers do (~3 s epochs, exported every 1 s): scrape during the run
    while proc.poll() is None:
        try:
            text = _get(f"http://127.0.0.1:{head['metrics']}/metrics", None)
            if "raytrain_test_acc" in text:
                prometheus = text
        except OSError:
            pass
        time.sleep(1)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    for name in ("raytrain_test_acc", "raytrain_train_loss", "raytrain_images_per_second"):
        assert name in prometheus, name
    assert 'run="mon"' in prometheus

    # Ray 2.60 serves Train V2 runs at .../v2/runs/v1 (.../v2/runs is the V1 state API).
    runs = json.loads(_get(f"http://127.0.0.1:{head['dashboard']}/api/train/v2/runs/v1",
                           token))
    mine = [r for r in runs["train_runs"] if r["name"] == "mon"]
    assert mine and mine[0]["status"] == "FINISHED", runs
    assert len(mine[0]["attempts"][-1]["workers"]) == 2

    run_dir = tmp_path / "mon"
    assert os.path.getsize(run_dir / "learning_curves.png") > 1000
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100

    progress = [m.group(1) for m in map(re.compile(r"^epoch\s+(\d+)/3 ").match,
                                        out.splitlines()) if m]
    assert progress == ["1", "2", "3"], out
    assert "Traceback" not in out and "(RayTrainWorker" not in out
