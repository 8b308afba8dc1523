"""Generate docs/recipes.md from the recipe schema (python scripts/gen_recipe_docs.py [--check])."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from hf_mixedprec.integrations.recipe import Recipe, builtin_recipe_names, load_recipe_file

OUT = Path(__file__).resolve().parent.parent / "docs" / "recipes.md"


#: Keys a section accepts besides its fields (shorthands its validators expand), by section class name: (the field
#: the row goes after, key, type, meaning).
EXTRA_KEYS: dict[str, list[tuple[str, str, str, str]]] = {
    "ModuleRule": [
        (
            "last_blocks",
            "first_last_blocks",
            "int or null",
            "Shorthand: first_blocks and last_blocks both N (not together with them).",
        )
    ],
}


def _validator(field: Any) -> str | None:
    """The name of the function a field's BeforeValidator runs, if any (it says which YAML forms are accepted)."""
    for m in field.metadata:
        func = getattr(m, "func", None)
        if func is not None:
            return func.__name__
    return None


def _family(ann: Any) -> Any:
    """The base of the kinds an annotation's tagged union holds (``FP8Config`` for the fp8 field), if any."""
    models = [m for m, _ in _models_in(ann)]
    if len(models) > 1 and all(hasattr(m, "family") for m in models):
        return models[0].family()
    return None


def _type(field: Any) -> str:
    ann = field.annotation
    family = _family(ann)
    if family is not None:  # a section that comes in kinds: named by its base, as code names "any fp8 section"
        return family.__name__ + (" or null" if type(None) in getattr(ann, "__args__", ()) else "")
    before = _validator(field)
    if before == "_names":  # one name or a list of names
        return "str or list of str"
    if before == "_on_off":  # off / on (YAML 1.1 booleans, or the words)
        return "off / on or null"
    text = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "")
    text = re.sub(r"hf_mixedprec\.[\w.]+\.(\w+)", r"\1", text).replace(" | None", " or null")
    # a list of sections (phases): tuple[Model, ...] behind a BeforeValidator that turns YAML lists into tuples
    text = re.sub(
        r"Optional\[Annotated\[tuple\[(\w+), \.\.\.\], BeforeValidator\([^)]*\)\]\]", r"list of \1 or null", text
    )
    text = re.sub(r"^Optional\[(.*)\]$", r"\1 or null", text)
    text = re.sub(r"Literal\[([^\]]*)\]", lambda m: m.group(1).replace("'", "").replace(", ", " / "), text)
    text = re.sub(r"^tuple\[(\w+), \.\.\.\]$", r"list of \1", text)  # a list of sections (modules)
    return text.replace("|", "/")


def _yaml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return ("on" if value else "off") if key == "fp8" else str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return "(section)"
    if field.is_required():
        return "required"
    if isinstance(field.default, tuple) and field.default and all(isinstance(d, BaseModel) for d in field.default):
        items = []  # a list of sections, as a recipe writes it: [{name: lm_head, select: lm_head, fp8: off}]
        for d in field.default:
            data = d.model_dump(by_alias=True, exclude_none=True)
            items.append("{" + ", ".join(f"{k}: {_yaml_value(k, v)}" for k, v in data.items()) + "}")
        return "`[" + ", ".join(items) + "]`"
    return f"`{field.default!r}`" if field.default is not None else "null"


def _models_in(ann: Any) -> list[tuple[type[BaseModel], bool]]:
    """The pydantic models an annotation holds, each with whether it is a list of them."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [(ann, False)]
    found = []
    for arg in getattr(ann, "__args__", ()):
        found += [(m, many or getattr(ann, "__origin__", None) is tuple) for m, many in _models_in(arg)]
    return found


def _section(model: type[BaseModel], prefix: str, out: list[str], seen: dict[type, str] | None = None) -> None:
    seen = {} if seen is None else seen
    rows = []
    nested = []
    extra = {after: (k, t, meaning) for after, k, t, meaning in EXTRA_KEYS.get(model.__name__, [])}
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        ann = field.annotation
        sub = _models_in(ann)
        rows.append(
            f"| `{key}` | `{_type(field)}` | {_default(field)} | {(field.description or '').replace('|', '/')} |"
        )
        if name in extra:
            k, t, meaning = extra[name]
            rows.append(f"| `{prefix}{k}` | `{t}` | null | {meaning} |")
        if sub:
            nested.append((_family(ann) or sub[0][0], f"{key}[]." if sub[0][1] else f"{key}."))
    out.append("| key | type | default | meaning |")
    out.append("| --- | --- | --- | --- |")
    out.extend(rows)
    out.append("")
    for sub_model, sub_prefix in nested:
        if sub_model in seen:
            continue
        seen[sub_model] = sub_prefix[:-1]
        shared = [p[:-1] for m, p in nested if m is sub_model]
        title = sub_prefix[:-1] if len(shared) == 1 else f"{prefix}<detector>"
        out.append(f"### `{title}`")
        out.append("")
        if sub_model.__doc__:
            out.append(sub_model.__doc__.strip().splitlines()[0])
            out.append("")
        if hasattr(sub_model, "KINDS"):
            _kinds_section(sub_model, sub_prefix, out)
        else:
            _section(sub_model, sub_prefix if len(shared) == 1 else f"{prefix}<detector>.", out, seen)


def _kinds_section(family: Any, prefix: str, out: list[str]) -> None:
    """A section that comes in kinds (``fp8`` by scaling, ``clipping`` by method): every key once, in the section's
    order, with the kinds it applies to and its default in each."""
    sel, kinds = family.SELECTOR, family.KINDS
    default = family.model_fields[sel].default
    out.append(
        f"One model per `{prefix}{sel}` (`{default}` when absent): the `{sel}` column names the kinds each key "
        "applies to; a key of another kind is an error."
    )
    out.append("")
    out.append(f"| key | {sel} | type | default | meaning |")
    out.append("| --- | --- | --- | --- | --- |")
    for key in family.SECTION_KEYS:
        owners = {name: kind.model_fields[key] for name, kind in kinds.items() if key in kind.model_fields}
        field = family.model_fields.get(key) or next(iter(owners.values()))
        applies = "all" if len(owners) == len(kinds) else ", ".join(owners)
        if key in family.model_fields:
            dflt = _default(field)
        else:
            per_kind = {name: _default(f) for name, f in owners.items()}
            same = len(set(per_kind.values())) == 1
            dflt = next(iter(per_kind.values())) if same else "; ".join(f"{n}: {d}" for n, d in per_kind.items())
        meaning = (field.description or "").replace("|", "/")
        out.append(f"| `{prefix}{key}` | {applies} | `{_type(field)}` | {dflt} | {meaning} |")
    out.append("")


def render() -> str:
    out = [
        "# Recipe reference",
        "",
        "Generated from the schema by `python scripts/gen_recipe_docs.py`; do not edit by hand.",
        "`hf-mixedprec schema` prints the same as JSON Schema. Unknown keys are errors; options that do not",
        "apply to the chosen `fp8.scaling` or `clipping.method` are errors too, and their defaults depend on it",
        "(`hf-mixedprec show NAME` prints a recipe with every value resolved).",
        "",
        "## Top level",
        "",
    ]
    _section(Recipe, "", out)
    out += ["## Built-in recipes", ""]
    for name in builtin_recipe_names():
        r = load_recipe_file(name)
        out.append(
            f"- `{name}` ({' -> '.join(r.precisions()) + ' phases' if r.phases else r.precision}"
            f"{', ' + r.fp8.scaling if r.fp8 else ''}; {', '.join(r.hardware)}): {r.description}"
        )
    out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/recipes.md is out of date")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/gen_recipe_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
