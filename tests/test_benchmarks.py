"""Every benchmark script still runs: its --quick mode (numbers meaningless) ends with its JSON
line or table and exit code 0, so none can rot unnoticed (augment_variants.py once failed on
import).

    python -m pytest -q tests/test_benchmarks.py
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
# script -> argv of its smoke test
QUICK = {
    "augment_variants.py": ["--quick"],
    "data_path.py": ["--quick", "--loader-workers", "0"],
    "gpu_throughput.py": ["--device", "cpu", "--quick", "--skip-run-worker"],
    "asha_replay.py": ["--quick"],
    "folder_ingest.py": ["--quick"],
    "listing.py": ["--quick"],
    "predict_throughput.py": ["--quick"],
    "recipe_effects.py": ["--quick"],
    "seed_ddp.py": ["--quick"],
}
# These start Ray clusters (a minute or more on 2 cores): their --quick runs when
# RAYTRAIN_BENCH_QUICK=1; the suite checks they import and parse their flags.
SLOW = {"launcher_overhead.py": ["--quick"], "tune_asha_vs_none.py": ["--quick"],
        "shutdown.py": ["--quick"]}


def test_every_script_is_smoke_tested():
    assert {p.name for p in BENCH.glob("*.py")} == set(QUICK) | set(SLOW)


def _run(script: str, argv: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    proc = subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=BENCH.parent, env=env)
    assert proc.returncode == 0, (script, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stdout


@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick(script):
    assert _run(script, QUICK[script], timeout=180).strip()


@pytest.mark.parametrize("script", sorted(SLOW))
def test_slow_benchmarks(script):
    if os.environ.get("RAYTRAIN_BENCH_QUICK") == "1":
        assert _run(script, SLOW[script], timeout=600).strip()
    else:
        assert "--quick" in _run(script, ["--help"], timeout=120)
