"""The commands in the user docs exist: every `hf-mixedprec SUBCOMMAND --flag` in a ```bash block of
docs/{quickstart,health,troubleshooting,scaling_out,fp8_backends,estimate,phases,storage,modules}.md is a real subcommand with real flags (checked against
the `--help` text and parsed with the CLI's own parser, never run), every `python scripts/X.py --flag` uses
flags from the script's parser, and the cheap commands (recipe validation, `launch --dry-run`) are run for real.

YAML recipes in the docs are ```yaml blocks whose first line is `# NAME.yaml`; the docs tell the reader to save
them under that name. They are written to a temporary folder here and validated (``broken*.yaml`` must fail).
"""

from __future__ import annotations

import ast
import re
import shlex
import textwrap
from pathlib import Path

import pytest

from hf_mixedprec.cli.app import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "docs" / f"{n}.md"
    for n in (
        "quickstart",
        "health",
        "troubleshooting",
        "scaling_out",
        "fp8_backends",
        "estimate",
        "phases",
        "storage",
        "modules",
    )
]
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)  # also fences indented in list items


def _blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for m in FENCE.finditer(doc.read_text(encoding="utf-8")):
            if m.group(2) == lang:
                out.append((doc.name, textwrap.dedent(m.group(3))))
    return out


def _commands(prefix: str) -> list[tuple[str, list[str]]]:
    """Command lines (tokenized, continuation lines joined, split at ; && || |) that start with ``prefix``."""
    found = []
    for doc, body in _blocks("bash"):
        body = re.sub(r"<<'(\w+)'\n.*?^\1$", "", body, flags=re.S | re.M)  # drop heredoc bodies
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            # split at ; && || | outside quotes (a `python -c "a; b"` stays one command)
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            part: list[str] = []
            for token in [*lexer, ";"]:
                if token in (";", "&&", "||", "|"):
                    if part and part[0] == prefix:
                        found.append((doc, part))
                    part = []
                else:
                    part.append(token)
    return found


def _subparsers() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("-") and not re.fullmatch(r"-\d.*", t)]


def test_docs_have_commands():
    cmds = _commands("hf-mixedprec")
    used = {tokens[1] for _, tokens in cmds}
    assert {"finetune", "report", "launch", "simulate", "validate"} <= used, used


def test_every_hf_mixedprec_command_and_flag_exists(capsys):
    with pytest.raises(SystemExit) as done:  # `hf-mixedprec --help`, in this process
        main(["--help"])
    assert done.value.code == 0
    top = capsys.readouterr().out
    subs = _subparsers()
    for doc, tokens in _commands("hf-mixedprec"):
        sub = tokens[1]
        assert re.search(rf"^\s+{re.escape(sub)}\s", top, re.M), f"{doc}: `hf-mixedprec {sub}` is not in --help"
        args = tokens[2:]
        if sub == "launch":  # everything after SCRIPT belongs to the script
            takes_value = {"--recipe", "--num-processes", "--config-dir"}
            script = next(
                i for i, t in enumerate(args) if not t.startswith("-") and (i == 0 or args[i - 1] not in takes_value)
            )
            args = args[:script]
        sub_help = subs[sub].format_help()
        for flag in _flags(args):
            assert re.search(rf"(^|[\s\[,]){re.escape(flag)}(?![\w-])", sub_help), (
                f"{doc}: {flag} is not in `{sub} --help`"
            )
        try:  # and the CLI's own parser accepts the whole line
            build_parser().parse_args(tokens[1:])
        except SystemExit as exc:
            pytest.fail(f"{doc}: `{shlex.join(tokens)}` does not parse ({exc})")


def _script_flags(path: Path) -> set[str]:
    """The option strings a script's argparse parser defines (read from its source, not imported)."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


def test_every_script_flag_exists():
    cmds = _commands("python")
    scripts = [(doc, t) for doc, t in cmds if len(t) > 1 and t[1].startswith("scripts/")]
    assert scripts
    for doc, tokens in scripts:
        path = ROOT / tokens[1]
        assert path.is_file(), f"{doc}: {tokens[1]} does not exist"
        known = _script_flags(path)
        for flag in _flags(tokens[2:]):
            assert flag in known, f"{doc}: {tokens[1]} has no {flag} (it has {sorted(known)})"


@pytest.fixture(scope="module")
def doc_yaml(tmp_path_factory) -> Path:
    """The docs' YAML recipes, saved under the names the docs give them."""
    folder = tmp_path_factory.mktemp("doc_yaml")
    for _doc, body in _blocks("yaml"):
        first = body.splitlines()[0]
        m = re.fullmatch(r"#\s*([\w.-]+\.yaml)\s*", first)
        if m:
            assert not (folder / m.group(1)).exists() or (folder / m.group(1)).read_text() == body, m.group(1)
            (folder / m.group(1)).write_text(body)
    return folder


def test_doc_recipes_validate(doc_yaml, monkeypatch, capsys):
    files = sorted(p.name for p in doc_yaml.glob("*.yaml"))
    good = [f for f in files if not f.startswith("broken")]
    assert len(good) >= 5, files
    monkeypatch.chdir(doc_yaml)  # in this process, as the broken ones below
    code = main(["validate", *good])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count(": ok (") == len(good)


def test_doc_broken_recipes_fail(doc_yaml, monkeypatch, capsys):
    bad = sorted(p.name for p in doc_yaml.glob("broken*.yaml"))
    assert bad
    monkeypatch.chdir(doc_yaml)
    for f in bad:  # in this process (`hf_mixedprec.cli.main` is what the entry point calls), to stay fast
        assert main(["validate", f]) == 2, f
        err = capsys.readouterr().err
        assert err and all(line.startswith(f"{f}: ") for line in err.splitlines()), err


def test_doc_launch_dry_runs(doc_yaml, monkeypatch, capsys):
    """Run every `launch ... --dry-run` of the docs as written (in a folder holding the docs' YAML files).

    They run in this process (``hf_mixedprec.cli.main``, what the ``hf-mixedprec`` entry point calls) to keep the
    test fast; `--dry-run` writes nothing and starts nothing.
    """
    monkeypatch.chdir(doc_yaml)
    # the docs show the plans made on a machine without CUDA; make that so here too (a GPU machine plans
    # `accelerate launch` instead of torch.distributed.run for the CPU DDP example)
    monkeypatch.setattr("hf_mixedprec.integrations.launch._detect_device_type", lambda: "cpu")
    expect = {
        "a100-fsdp2.yaml": ["distributed_type: FSDP", "fsdp_version: 2", "mixed_precision: bf16"],
        "v100-zero2.yaml": ['"stage": 2', '"initial_scale_power": 16', "distributed_type: DEEPSPEED"],
        "h100-2nodes.yaml": ["num_machines: 2", "num_processes: 16", "main_process_ip: 10.0.0.1"],
        # no Transformer Engine here: auto resolves in the training process, Accelerate runs BF16 and says why
        "h100-fp8-delayed": ["mixed_precision: bf16", "Transformer Engine is not installed here", "num_processes: 8"],
        "cpu-bf16": ["torch.distributed.run", "--nproc_per_node 2", "distributed_type: MULTI_CPU"],
    }
    runs = [t for _, t in _commands("hf-mixedprec") if t[1] == "launch" and "--dry-run" in t]
    assert len(runs) >= 4
    seen = set()
    for tokens in runs:
        recipe = tokens[tokens.index("--recipe") + 1]
        rc = main(tokens[1:])
        out, err = capsys.readouterr()
        assert rc == 0, (tokens, err)
        assert out.startswith("# command\n")
        for text in expect.get(recipe, []):
            assert text in out, (recipe, text)
        seen.add(recipe)
    assert {"a100-fsdp2.yaml", "v100-zero2.yaml", "cpu-bf16"} <= seen


def test_doc_deepspeed_refusals_run_as_written(doc_yaml, monkeypatch, capsys):
    """The docs' DeepSpeed refusals, run as written: exit 2 and the very line the docs show, before any process."""
    import torch

    from hf_mixedprec.integrations.deepspeed import deepspeed_fp16_supported

    if torch.cuda.is_available() or deepspeed_fp16_supported("cpu"):
        pytest.skip("DeepSpeed has FP16 on this machine: the docs' refusal is for a CPU without AVX512-FP16")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.chdir(doc_yaml)
    if not (doc_yaml / "scripts").exists():
        (doc_yaml / "scripts").symlink_to(ROOT / "scripts")
    shown = (ROOT / "docs" / "scaling_out.md").read_text(encoding="utf-8")
    runs = [t for _, t in _commands("hf-mixedprec") if t[1] == "launch" and "--dry-run" not in t]
    refused = [t for t in runs if t[t.index("--recipe") + 1] == "v100-zero2.yaml"]
    assert refused
    for tokens in refused:
        rc = main(tokens[1:])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, (tokens, err)
        assert err[0] in shown, err[0]
    assert not list(doc_yaml.glob("runs")), "nothing was started"
