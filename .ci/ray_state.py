"""What Ray left on this machine: the address file and Ray's processes. .ci/run records it
before the suite and fails after it when anything differs (issue #28: no test leaves Ray state).

    python .ci/ray_state.py > before.json        # record
    python .ci/ray_state.py --same-as before.json  # exit 1, naming what is left, if it differs
"""

import argparse
import json
import os
import sys
import time

import psutil

ADDRESS_FILE = os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp",
                            "ray", "ray_current_cluster")
RAY_PROCESSES = ("gcs_server", "raylet", "dashboard.py", "log_monitor.py", "monitor.py",
                 "default_worker.py", "runtime_env_agent", "dashboard_agent")


def state() -> dict:
    try:
        with open(ADDRESS_FILE) as f:
            address = f.read().strip()
    except FileNotFoundError:
        address = None
    procs = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
        if any(name in cmd for name in RAY_PROCESSES) or cmd.startswith("ray::"):
            procs.append(f"{p.info['pid']} {cmd[:160]}")
    return {"address_file": address, "ray_processes": sorted(procs)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--same-as", help="a state recorded before")
    args = p.parse_args()
    now = state()
    if not args.same_as:
        print(json.dumps(now))
        return 0
    with open(args.same_as) as f:
        before = json.load(f)
    for _ in range(30):  # a cluster shut down a moment ago: its processes exit within seconds
        if set(now["ray_processes"]) <= set(before["ray_processes"]):
            break
        time.sleep(1)
        now = state()
    left = []
    if now["address_file"] != before["address_file"]:
        left.append(f"{ADDRESS_FILE}: {before['address_file']!r} before, "
                    f"{now['address_file']!r} after")
    left += [f"Ray process left: {p}" for p in now["ray_processes"]
             if p not in before["ray_processes"]]
    for line in left:
        print(f"ray state: {line}", file=sys.stderr)
    print("ray state: as the suite found it" if not left else
          f"ray state: {len(left)} thing(s) left behind", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
