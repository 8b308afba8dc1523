"""Write the precision maps of the tiny example models into docs/modules.md (python scripts/gen_precision_maps.py
[--check]).

Each map is what `hf-mixedprec plan` prints for one config under one recipe, run as a command here (so the docs show
exactly what a reader gets), and goes between the doc's marker comments, after the command in a ```bash block::

    <!-- precision-map:tiny-llama -->
    ...
    <!-- /precision-map -->

Text outside the markers is left as it is.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "modules.md"
RECIPE = "h100-fp8-current"
MODELS = ("tiny-llama", "tiny-gpt2", "tiny-mixtral")
END = "<!-- /precision-map -->"


def command(model: str) -> list[str]:
    """The command line the docs show for one model (relative paths: run from the repository root)."""
    return ["hf-mixedprec", "plan", "--config", f"examples/model_configs/{model}/config.json", "--recipe", RECIPE]


def run_maps() -> dict[str, str]:
    """What each command prints, the three run side by side (as ``python -m hf_mixedprec.cli``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = {
        m: subprocess.Popen(
            [sys.executable, "-m", "hf_mixedprec.cli", *command(m)[1:]],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in MODELS
    }
    out = {}
    for m, p in procs.items():
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(command(m))} failed (exit {p.returncode}):\n{stderr}")
        out[m] = stdout.rstrip("\n")
    return out


def block(model: str, text: str) -> str:
    """The generated text between one model's markers."""
    cmd = " ".join(command(model))
    return f"<!-- precision-map:{model} -->\n\n```bash\n{cmd}\n```\n\n{text}\n\n{END}"


def render(doc: str, maps: dict[str, str]) -> str:
    """``doc`` with every model's markers holding its map; a model whose markers are missing is an error."""
    for model, text in maps.items():
        found = re.search(rf"<!-- precision-map:{re.escape(model)} -->.*?{re.escape(END)}", doc, re.S)
        if found is None:
            raise SystemExit(f"{OUT}: no <!-- precision-map:{model} --> ... {END} markers")
        doc = doc[: found.start()] + block(model, text) + doc[found.end() :]
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the maps in docs/modules.md are out of date")
    args = ap.parse_args()
    doc = OUT.read_text(encoding="utf-8")
    text = render(doc, run_maps())
    if args.check:
        if text != doc:
            print(f"{OUT} is out of date: run python scripts/gen_precision_maps.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
