"""Fixed costs of a run (issue #27): a cluster raytrain starts knows its own address and has
its worker processes started, with torch imported, before a run asks for them. The measured
effect (time to first step, wall, per-epoch cost, Tune) is in benchmarks/launcher_overhead.py;
these tests check the mechanism, not a time."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# A new cluster from ray_compat.init_local, in its own process (the session cluster is cold).
PROBE = textwrap.dedent("""
    import json, os, sys, time
    from raytrain import ray_compat
    before = dict(os.environ)
    ctx = ray_compat.init_local(3, logging_level="ERROR", num_cpus=2)
    import ray
    time.sleep(8)  # the raylet starts its warm workers as the driver connects
    asked = time.time()

    @ray.remote(num_cpus=1)
    class Probe:
        def facts(self):
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/uptime") as f:
                started = time.time() - float(f.read().split()[0]) + ticks / os.sysconf(
                    "SC_CLK_TCK")
            return {"address": os.environ.get("RAY_ADDRESS"), "started": started,
                    "torch": "torch" in sys.modules,
                    "raytrain": "raytrain.worker.ray_entry" in sys.modules}

    facts = ray.get([p.facts.remote() for p in (Probe.remote(), Probe.remote())])
    out = {"gcs": ctx.address_info["gcs_address"], "driver": os.environ.get("RAY_ADDRESS"),
           "asked": asked, "facts": facts}
    ray_compat.shutdown()
    mine = ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT", "RAY_enable_worker_prestart",
            "RAY_num_prestart_python_workers", "RAY_num_workers_soft_limit",
            "RAY_preload_python_modules")  # Ray's own ray.init sets others (RAY_AUTH_MODE...)
    out["restored"] = all(os.environ.get(k) == before.get(k) for k in mine)
    print(json.dumps(out))
""")


def test_a_new_cluster_knows_its_address_and_starts_warm_workers():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=240, env={k: v for k, v in __import__("os").environ.items()
                                            if k != "RAY_ADDRESS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["driver"] == out["gcs"]  # not what /tmp/ray/ray_current_cluster says
    for facts in out["facts"]:
        assert facts["address"] == out["gcs"]  # every process Ray starts inherits it
        assert facts["torch"] and facts["raytrain"]  # imported before the actor was asked for
        assert facts["started"] < out["asked"]  # a process started ahead, not on demand
    assert out["restored"]  # the driver's environment as it was before the cluster
