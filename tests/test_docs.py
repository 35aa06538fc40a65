"""The manual stays true: docs/flags.md is the parser's, the README stays short, and every
relative link in README.md and docs/*.md leads to a file that exists.

    python -m pytest -q tests/test_docs.py
"""

from __future__ import annotations

import glob
import os
import re

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


def test_every_relative_link_points_to_an_existing_file():
    broken = []
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)} -> {target}")
    assert not broken, broken
