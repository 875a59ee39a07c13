"""Every wall time on the pages of a first hour carries the load it was measured at, or says it was not recorded
(issue 41, section 2: "42 s", "about a minute" and "~30 s" said nothing of the machine's other jobs, and one
command had three figures).  A paragraph (or a code comment line) that states a time in seconds or minutes must
mention the load; the lines listed in :data:`NOT_MEASUREMENTS` state settings or goals, not measurements.

The measurement pages (performance.md, scale.md, serving.md's Measurements, ...) state the load per section."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: page -> the heading where its measurement sections start (None: the whole page)
PAGES = {"README.md": None, "docs/demo.md": None, "docs/networks.md": None, "docs/cli.md": None,
         "docs/evaluation.md": None, "docs/python-api.md": None, "docs/serving.md": "## Measurements",
         "recipes/README.md": "## CPU recipe", "docs/feedback.md": "## Measured cost", "docs/llm-features.md": None,
         "docs/defaults.md": None, "docs/how-it-works.md": None}
TIME = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?:\s?[–-]\s?\d+(?:[.,]\d+)?)?\s?(?:s|min|minutes?|seconds?)\b(?!\s*(?:per|/))"
                  r"|\b(?:a few|several|about a|half a) (?:minutes?|seconds?)\b|\bin (?:minutes|seconds)\b")
#: lines with a time that is not a measurement (a goal, a setting)
NOT_MEASUREMENTS = ("default run < 10 min on 2 CPU cores",)


def _paragraphs(page: str):
    text = (ROOT / page).read_text(encoding="utf-8")
    stop = PAGES[page]
    if stop and stop in text:
        text = text[:text.index(stop)]
    return re.split(r"\n\s*\n", text)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_wall_times_carry_their_load(page):
    missing = []
    for para in _paragraphs(page):
        for line in para.splitlines():
            if not TIME.search(line) or any(s in line for s in NOT_MEASUREMENTS):
                continue
            where = line if line.lstrip().startswith(("#", "sdm-mlx", "python", "<!--")) or "  # " in line else para
            if "load" not in where.lower():
                missing.append(line.strip())
    assert not missing, f"{page}: wall times without their load:\n" + "\n".join(missing)
