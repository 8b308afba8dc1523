"""The package's shape: one folder per layer, in the order docs/architecture.md lists them; a folder imports only from
itself and the folders below it, with no cycle anywhere; no function over 80 lines and no class over 300. A module's
``if __name__ == "__main__":`` block is an entry point of its own (``cli.finetune:__main__``), in the entry-points
layer, that depends on its module."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hf_mixedprec"


def _modules() -> dict[str, Path]:
    """Dotted names relative to the package ("runtime", "fp8.emulated"; the package itself is "hf_mixedprec")."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "hf_mixedprec"] = f
    return out


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _imports(path: Path, modules: dict[str, Path], *, main: bool = False) -> set[str]:
    """The package modules ``path`` imports anywhere (function bodies too), except in ``__main__`` blocks; with
    ``main``, those its ``__main__`` blocks import."""
    tree = ast.parse(path.read_text())
    inside = {id(n) for top in tree.body if _is_main_guard(top) for n in ast.walk(top)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if (id(node) in inside) != main:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hf_mixedprec":
            base = node.module.removeprefix("hf_mixedprec").lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                if sub in modules:
                    found.add(sub)
                elif base:
                    found.add(base)
                else:
                    found.add("hf_mixedprec")  # a name from the package's __init__
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_mixedprec":
                    found.add(alias.name.removeprefix("hf_mixedprec").lstrip(".") or "hf_mixedprec")
    return found


def _layers() -> list[list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    return [line.split(":", 1)[1].split() for line in block.strip().splitlines()]


def _layer_of(module: str, layers: list[list[str]]) -> int:
    entry = ":" in module  # a __main__ block is matched by the entry-point pattern only, not by its folder's
    hits = [
        i for i, names in enumerate(layers) if any(fnmatch.fnmatchcase(module, n) for n in names if (":" in n) == entry)
    ]
    assert len(hits) == 1, f"{module} is in {len(hits)} layers of docs/architecture.md (expected exactly one)"
    return hits[0]


def _graph() -> dict[str, set[str]]:
    """Every module and every ``__main__`` block (``name:__main__``, which depends on its module) -> what it imports."""
    modules = _modules()
    graph = {name: {d for d in _imports(path, modules) if d != name and d in modules} for name, path in modules.items()}
    for name, path in modules.items():
        if any(_is_main_guard(top) for top in ast.parse(path.read_text()).body):
            graph[f"{name}:__main__"] = {name} | {d for d in _imports(path, modules, main=True) if d in modules}
    return graph


def test_every_module_is_in_one_layer_and_imports_only_downward():
    layers = _layers()
    upward = []
    for name, deps in _graph().items():
        mine = _layer_of(name, layers)
        for dep in deps:
            if _layer_of(dep, layers) > mine:
                upward.append(f"{name} (layer {mine}) imports {dep} (layer {_layer_of(dep, layers)})")
    assert upward == []


def test_the_entry_points_are_counted_and_finetune_is_run_through_one():
    graph = _graph()
    assert {"cli.finetune:__main__", "cli.__main__:__main__", "__main__:__main__"} <= set(graph)
    # the launched script is a module of the CLI's own; the finetune command never imports the CLI back
    assert "cli.app" in graph["cli.finetune"] and not any(d.startswith("cli") for d in graph["commands.finetune"])


def test_the_top_level_is_the_folders_of_the_layers():
    """Every module lives in the folder of its layer: at the top only the package's __init__ and __main__, py.typed,
    and one folder per layer (each a package whose docstring says what lives there and what it may import)."""
    entries = sorted(p.name for p in PKG.iterdir() if p.name != "__pycache__")
    folders = [p for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert sorted(e for e in entries if not (PKG / e).is_dir()) == ["__init__.py", "__main__.py", "py.typed"]
    assert len(entries) <= 13, entries
    layers = _layers()
    for folder in folders:
        assert (folder / "__init__.py").is_file(), folder.name
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{folder.name}/__init__.py has no docstring"
        # the folder is one layer of docs/architecture.md, by its own name
        assert any(folder.name in names for names in layers), f"{folder.name}/ is in no layer of docs/architecture.md"


def test_a_folder_imports_only_folders_below_it():
    """Between folders the layer order is a total order (docs/architecture.md), and every edge points down it."""
    layers = _layers()
    order = {name: i for i, names in enumerate(layers) for name in names if "." not in name and "*" not in name}
    upward = sorted(
        {
            f"{name.split('.')[0]}/ -> {dep.split('.')[0]}/"
            for name, deps in _graph().items()
            for dep in deps
            if order.get(dep.split(".")[0].split(":")[0], -1) > order.get(name.split(".")[0].split(":")[0], 99)
        }
    )
    assert upward == []


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ is imported before its modules: that edge is no cycle of ours
    for name in graph:
        if "." in name:
            graph[name].discard(name.rsplit(".", 1)[0])
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_long_function_or_class():
    too_long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                size = node.end_lineno - node.lineno + 1
                limit = 300 if isinstance(node, ast.ClassDef) else 80
                if size > limit:
                    too_long.append(f"{name}.{node.name}: {size} lines (limit {limit})")
    assert too_long == []
