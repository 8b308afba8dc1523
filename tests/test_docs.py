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
