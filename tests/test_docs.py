"""The manual stays true: docs/flags.md is the parser's, the README stays short, and every
relative link in README.md and docs/*.md leads to a file that exists.

    python -m pytest -q tests/test_docs.py
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

from tools import flags_md

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)


def test_flags_page_is_what_the_parser_says():
    with open(flags_md.PAGE) as f:
        committed = f.read()
    assert committed == flags_md.render(), "docs/flags.md is stale: run python tools/flags_md.py"


def test_flags_page_names_every_flag_of_the_parser():
    from raytrain.cli import build_parser

    with open(flags_md.PAGE) as f:
        page = f.read()
    flags = {o for a in build_parser()._actions for o in a.option_strings if o != "--help"}
    missing = sorted(f for f in flags if f.startswith("--")
                     and not re.search(re.escape(f) + r"(?![\w-])", page))
    assert not missing, missing


def test_readme_is_at_most_300_lines():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 300, len(lines)


def _anchors(page: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -1, -2 for
    repeats."""
    with open(page) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # no headings in code blocks
    ids, counts = set(), {}
    for title in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = counts[slug] = counts.get(slug, -1) + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def test_every_relative_link_points_to_an_existing_file_and_heading():
    broken = []
    for page in PAGES:
        with open(page) as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)} -> {target}")
            elif anchor and path.endswith(".md") and anchor not in _anchors(path):
                broken.append(f"{os.path.relpath(page, ROOT)} -> {target} (no such heading)")
    assert not broken, broken


def test_the_own_data_pages_pack_commands_run(ray_cluster, tmp_path):
    """docs/own-data.md's offline walkthrough: `pack --from digits DIR`, then `pack DIR OUT`
    (against the session's cluster, as --address lets it); the fit commands that follow are
    tests/test_own_data.py's."""
    folder, shards = tmp_path / "digits-folder", tmp_path / "digits-parquet"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    export = subprocess.run([sys.executable, "-m", "raytrain.pack", "--from", "digits",
                             str(folder)], capture_output=True, text=True, timeout=120, env=env)
    assert export.returncode == 0, export.stderr[-2000:]
    assert sum(len(files) for _, _, files in os.walk(folder)) == 1797
    packed = subprocess.run([sys.executable, "-m", "raytrain.pack", str(folder), str(shards),
                             "--address", ray_cluster.address_info["address"]],
                            capture_output=True, text=True, timeout=300, env=env)
    assert packed.returncode == 0, packed.stderr[-2000:]
    assert "packed 1437 train and 360 val images" in packed.stdout
    assert json.loads((shards / "classes.json").read_text()) == [str(d) for d in range(10)]
    assert os.listdir(shards / "train") and os.listdir(shards / "val")
