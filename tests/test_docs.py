"""Docs that are generated stay in sync with the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_recipe_reference_is_up_to_date():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_recipe_docs.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    text = (ROOT / "docs" / "recipes.md").read_text()
    for key in ("`fp8.amax_history_len`", "`loss_scale.hysteresis`", "`clipping.z_thresh`", "`distributed.zero_stage`"):
        assert key in text


def test_metric_table_in_health_md_is_the_one_in_the_code():
    """docs/health.md's `mp/` metric table lists exactly :data:`hf_mixedprec.core.metrics.METRICS`, same words."""
    from hf_mixedprec.core.metrics import METRICS

    text = (ROOT / "docs" / "health.md").read_text()
    table = text[text.index("| metric | meaning |") :].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        name, meaning = (c.strip() for c in line.strip("|").split(" | ", 1))
        rows[name.replace("`", "")] = meaning
    assert rows == METRICS
