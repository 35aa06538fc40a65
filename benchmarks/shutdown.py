"""How long a local cluster's shutdown takes: Ray's own order against raytrain's (the autoscaler
monitor SIGKILLed first, ray_compat.SHUTDOWN_ORDER), alternating, on fresh clusters.

    python benchmarks/shutdown.py --pairs 3

Each cluster: ``ray_compat.init_local(num_cpus=2)``, four tasks (so worker processes exist), 2 s
idle, then ``ray_compat.shutdown()`` timed; "ray order" runs it with the internal made missing
(its fallback). Prints one line per cluster and the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def one(monitor_first: bool) -> float:
    import ray

    from raytrain import ray_compat

    real = ray_compat._internal  # noqa: SLF001 - the fallback path, as tests/test_architecture

    def internal(module, name=None):
        return None if module == "ray._private.worker" else real(module, name)

    ray_compat.init_local(num_cpus=2, logging_level="ERROR")
    try:
        ray.get([ray.remote(lambda: 1).remote() for _ in range(4)])
        time.sleep(2)
        if not monitor_first:
            ray_compat._internal = internal  # noqa: SLF001
        t0 = time.monotonic()
        ray_compat.shutdown()
        return time.monotonic() - t0
    finally:
        ray_compat._internal = real  # noqa: SLF001
        if ray.is_initialized():
            ray_compat.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 pair")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {"ray order": [], "monitor first": []}
    for i in range(1 if args.quick else args.pairs):
        for name in (("ray order", "monitor first") if i % 2 == 0 else
                     ("monitor first", "ray order")):
            times[name].append(round(one(name == "monitor first"), 2))
            print(f"pair {i + 1}: {name}: shutdown {times[name][-1]:.2f} s", flush=True)
    print(json.dumps({k: {"median_s": statistics.median(v), "runs_s": v}
                      for k, v in times.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
