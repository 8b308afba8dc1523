"""Reading recipes: built-in names and YAML paths, ``extends:`` chains, and the one-line error text.

A path is a path (a separator or a ``.yaml``/``.yml`` suffix) and a bare name is a built-in; ``extends:`` is
resolved next to the file that says it. The YAML is read by :mod:`hf_mixedprec.recipes.safe_yaml` (bounded, no aliases,
no tags), validated by :class:`hf_mixedprec.recipes.schema.RecipeSpec`, and every problem becomes one
``source: dotted.key: message`` line of a :class:`~hf_mixedprec.core.errors.RecipeError`. The loaders take the class
to build (``cls``), so the facade above the integrations (:mod:`hf_mixedprec.integrations.recipe`) gets its own
:class:`~hf_mixedprec.integrations.recipe.Recipe` without this module importing it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, Tag, ValidationError

from hf_mixedprec.core._text import shown
from hf_mixedprec.core.errors import Problem, RecipeError
from hf_mixedprec.recipes.detectors import LAYER_DETECTORS
from hf_mixedprec.recipes.kinds import _CLIP_PARAMS, fp8_options_dropped_on_switch
from hf_mixedprec.recipes.safe_yaml import YAMLRefusal, load_recipe_yaml, read_recipe_text
from hf_mixedprec.recipes.schema import RecipeSpec

__all__ = ["builtin_recipe_names", "builtin_recipe_path", "load_recipe_file", "parse_recipe_yaml", "resolve_recipe"]

R = TypeVar("R", bound=RecipeSpec)


def _describe_input(value: Any) -> str:
    return shown(value)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``, ``tuple[X, ...]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _tagged(annotation: Any) -> dict[str, type[BaseModel]]:
    """The members of the tagged unions an annotation holds, by tag (``fp8``: one model per scaling)."""
    found: dict[str, type[BaseModel]] = {}
    for arg in get_args(annotation):
        tags = [m.tag for m in getattr(arg, "__metadata__", ()) if isinstance(m, Tag)]
        if tags:
            found[tags[0]] = get_args(arg)[0]
        else:
            found.update(_tagged(arg))
    return found


def _located(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], type[BaseModel] | None]:
    """An error's location in a recipe without the tags pydantic puts in it inside a tagged union
    (``fp8.current.margin`` is ``fp8.margin`` to the user), and the model the location ends in, if any."""
    model: type[BaseModel] | None = RecipeSpec
    tags: dict[str, type[BaseModel]] = {}
    out: list[Any] = []
    for part in loc:
        if isinstance(part, str) and part in tags:  # the member of the union just entered
            model, tags = tags[part], {}
            continue
        out.append(part)
        if isinstance(part, int):  # an index into a list of sections (phases)
            continue
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
        tags = _tagged(field.annotation) if field is not None else {}
    return tuple(out), model


def _allowed_keys(model: type[BaseModel]) -> list[str]:
    """The keys a section accepts: every kind's for a section that comes in kinds (``SECTION_KEYS``), else its
    fields; and the shorthands its validators expand."""
    keys = list(getattr(model, "SECTION_KEYS", ())) or [f.alias or n for n, f in model.model_fields.items()]
    return keys + list(getattr(model, "SHORTHAND_KEYS", ()))


def _problems_from(err: ValidationError, source: str) -> list[Problem]:
    return _problems_in(err.errors(), source, ())


def _problems_in(errors: list[Any], source: str, prefix: tuple[Any, ...]) -> list[Problem]:
    problems = []
    for e in errors:
        raw = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        own, _ = _located(raw)
        loc = prefix + own
        etype = e["type"]
        ctx = e.get("ctx") or {}
        key = ".".join(str(p) for p in loc)
        if etype == "recipe_phase":  # one phase, validated as a recipe of its own
            problems += _problems_in(ctx["errors"], source, ("phases", ctx["index"]))
            continue
        if etype == "recipe_rule":
            key = ".".join(x for x in (key, ctx["key"]) if x)
            msg = ctx["message"]
        elif etype == "extra_forbidden":
            _, parent = _located(raw[:-1])  # a phase's own errors are located in a recipe of its own
            allowed = ", ".join(_allowed_keys(parent)) if parent else "see `hf-mixedprec schema`"
            msg = f"unknown key (allowed: {allowed})"
        elif etype in ("literal_error", "enum"):
            expected = str(ctx.get("expected", "")).replace("'", "").replace(" or ", ", ")
            msg = f"{_describe_input(e['input'])} is not allowed (allowed: {expected})"
        elif etype == "missing":
            msg = "is required"
        elif etype in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[etype]
            bound = next(iter(ctx.values()))
            bound = f"{bound:g}" if isinstance(bound, float) else bound
            msg = f"{_describe_input(e['input'])} is out of range (allowed: {op} {bound})"
        elif etype == "too_long":
            msg = f"{ctx.get('actual_length', '?')} items (allowed: at most {ctx.get('max_length', '?')})"
        elif etype == "string_pattern_mismatch":
            msg = f"{_describe_input(e['input'])} is not a valid name (allowed: letters, digits, '-', '_', '.')"
        elif etype in ("model_type", "model_attributes_type", "dict_type"):
            msg = f"expected a mapping, got {_describe_input(e['input'])}"
        else:
            msg = f"{e['msg'][0].lower()}{e['msg'][1:]}, got {_describe_input(e['input'])}"
        problems.append(Problem(source, key, msg))
    return problems


# -- loading ---------------------------------------------------------------------------------------


def builtin_recipe_names() -> list[str]:
    """Names of the recipes shipped with the package, in a stable order."""
    folder = resources.files("hf_mixedprec") / "recipes" / "builtin"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def builtin_recipe_path(name: str) -> Path:
    return Path(str(resources.files("hf_mixedprec") / "recipes" / "builtin" / f"{name}.yaml"))


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = load_recipe_yaml(text)
    except YAMLRefusal as exc:
        raise RecipeError([Problem(source, "", str(exc))]) from None
    except yaml.constructor.ConstructorError as exc:
        tag = getattr(exc, "problem", "") or str(exc)
        line = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark else ""
        raise RecipeError([Problem(source, "", f"refused YAML tag{line}: {tag}; recipes are plain data")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError([Problem(source, "", f"invalid YAML: {where}{what}")]) from None
    if data is None:
        raise RecipeError(
            [Problem(source, "", "the document is empty (expected a mapping with at least name and precision)")]
        )
    if not isinstance(data, dict):
        raise RecipeError([Problem(source, "", f"expected a mapping at the top level, got {type(data).__name__}")])
    bad = [k for k in _walk_keys(data) if not isinstance(k[-1], str)]
    if bad:
        raise RecipeError([Problem(source, ".".join(map(str, k)), "keys must be strings") for k in bad])
    return data


def _walk_keys(data: Mapping[Any, Any], prefix: tuple[Any, ...] = ()) -> Iterable[tuple[Any, ...]]:
    for k, v in data.items():
        yield (*prefix, k)
        if isinstance(v, Mapping):
            yield from _walk_keys(v, (*prefix, k))


def _read_source(
    name_or_path: str | os.PathLike[str], relative_to: Path | None = None
) -> tuple[dict[str, Any], str, Path | None]:
    """Find a recipe by path or built-in name; return its raw mapping, a display name and its path.

    A path is a path (it has a separator or ends in ``.yaml``/``.yml``); anything else is a built-in name. A
    relative path inside a recipe (``extends:``) is read next to that recipe (``relative_to``), never from the
    current directory. A file that is not ``.yaml``/``.yml`` is refused unread, so no other file's contents
    can end up in an error message.
    """
    text_name = os.fspath(name_or_path)
    suffix_ok = text_name.endswith((".yaml", ".yml"))
    looks_like_path = suffix_ok or os.sep in text_name or "/" in text_name
    names = builtin_recipe_names()
    if not looks_like_path:
        if text_name in names:
            shadow = (relative_to or Path.cwd()) / text_name
            if shadow.exists():
                raise RecipeError(
                    [
                        Problem(
                            text_name,
                            "",
                            f"is both the built-in recipe {text_name!r} and the file {str(shadow)!r} (allowed: "
                            f"the name alone for the built-in, or ./{text_name} with a .yaml suffix for a file)",
                        )
                    ]
                )
            p = builtin_recipe_path(text_name)
            return _parse_yaml(p.read_text(encoding="utf-8"), text_name), text_name, None
        raise RecipeError(
            [Problem(text_name, "", f"no such recipe (allowed: a YAML path or one of: auto, {', '.join(names)})")]
        )
    path = Path(text_name).expanduser()
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if not suffix_ok:
        raise RecipeError([Problem(str(path), "", "is not a .yaml/.yml file (allowed: a recipe YAML file)")])
    if not path.is_file():
        where = f" next to the recipe that names it ({path})" if relative_to is not None else ""
        raise RecipeError(
            [
                Problem(
                    str(path), "", f"file not found{where} (allowed: a YAML path or one of: auto, {', '.join(names)})"
                )
            ]
        )
    try:
        text = read_recipe_text(path)
    except YAMLRefusal as exc:
        raise RecipeError([Problem(str(path), "", str(exc))]) from None
    except OSError as exc:
        raise RecipeError([Problem(str(path), "", f"cannot read: {exc.strerror or exc}")]) from None
    return _parse_yaml(text, str(path)), str(path), path.resolve()


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge mappings; an explicit null in ``override`` removes the key; lists are replaced."""
    out = dict(base)
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _resolve_raw(data: Mapping[str, Any], source: str, base_dir: Path | None, chain: tuple[str, ...]) -> dict[str, Any]:
    parent = data.get("extends")
    if parent is None:
        return dict(data)
    if not isinstance(parent, str) or not parent:
        raise RecipeError([Problem(source, "extends", f"{_describe_input(parent)} is not a recipe name or path")])
    try:
        raw, parent_source, parent_path = _read_source(parent, base_dir)
    except RecipeError as exc:
        detail = exc.problems[0].message
        raise RecipeError([Problem(source, "extends", f"{parent!r}: {detail}")]) from None
    ident = str(parent_path) if parent_path else parent_source
    if ident in chain:
        raise RecipeError([Problem(source, "extends", f"cycle: {_cycle_text([*chain, ident])}")])
    resolved_parent = _resolve_raw(raw, parent_source, parent_path.parent if parent_path else None, (*chain, ident))
    child = {k: v for k, v in data.items() if k != "extends"}
    return _merge(_drop_switched_options(resolved_parent, child), child)


def _cycle_text(chain: list[str]) -> str:
    """``a.yaml -> b.yaml -> a.yaml (in DIR)`` when the files share a folder, so that long paths cannot push the
    names out of the one-line message; else the full chain."""
    paths = [Path(c) for c in chain]
    if all(p.is_absolute() for p in paths) and len({p.parent for p in paths}) == 1:
        return f"{' -> '.join(p.name for p in paths)} (in {paths[0].parent})"
    return " -> ".join(chain)


def _drop_switched_options(parent: dict[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """A child that switches ``clipping.method`` or ``fp8.scaling`` does not inherit the parent's options for
    the old method/scaling (``alpha`` of zclip under ``norm``, ``amax_history_len`` of delayed under mxfp8; the
    ``format`` and the per-layer FP8 health thresholds across nvfp4 and an FP8 scaling)."""
    out = dict(parent)
    for section, selector in (("clipping", "method"), ("fp8", "scaling")):
        mine, theirs = child.get(section), out.get(section)
        if not (isinstance(mine, Mapping) and isinstance(theirs, Mapping)):
            continue
        if selector in mine and mine[selector] != theirs.get(selector):
            dropped = (
                fp8_options_dropped_on_switch(theirs.get(selector), mine[selector])
                if section == "fp8"
                else set(_CLIP_PARAMS)
            )
            if not dropped:
                continue
            out[section] = {k: v for k, v in theirs.items() if k not in dropped}
            if section == "fp8" and "format" in dropped and "health" in out:
                out["health"] = _drop_layer_thresholds(out["health"])
    return out


def _drop_layer_thresholds(health: Any) -> Any:
    """``health`` without the per-layer FP8 detectors' thresholds (``fp8_sqnr``, ``fp8_underflow``, ...): a child
    that switches to or from nvfp4 gets those of its own format (its own, or the defaults of its scaling: FP8's, or
    an nvfp4 recipe's, ``recipes.detectors.NVFP4_LAYER_THRESHOLDS``), not ones set for FP4's coarser grid or FP8's
    finer one. Their other keys (reaction, ...) are kept."""
    if not isinstance(health, Mapping) or not isinstance(health.get("detectors"), Mapping):
        return health
    detectors = dict(health["detectors"])
    for name in LAYER_DETECTORS:
        if isinstance(detectors.get(name), Mapping):
            detectors[name] = {k: v for k, v in detectors[name].items() if k != "threshold"}
    return {**health, "detectors": detectors}


def resolve_recipe(
    data: Mapping[str, Any],
    *,
    source: str = "<dict>",
    base_dir: Path | None = None,
    _ident: str | None = None,
    cls: type[R] = RecipeSpec,  # type: ignore[assignment]
) -> R:
    """Validate a raw mapping (following ``extends``) into ``cls``, or raise :class:`RecipeError`."""
    merged = _resolve_raw(data, source, base_dir, (_ident or source,))
    merged.pop("extends", None)
    try:
        return cls.model_validate(merged)
    except ValidationError as exc:
        raise RecipeError(_problems_from(exc, source)) from None


def load_recipe_file(name_or_path: str | os.PathLike[str], *, cls: type[R] = RecipeSpec) -> R:  # type: ignore[assignment]
    """Load a built-in recipe by name, or a YAML file by path, resolving ``extends``. No hardware check."""
    raw, source, path = _read_source(name_or_path)
    ident = str(path) if path else source
    return resolve_recipe(raw, source=source, base_dir=path.parent if path else None, _ident=ident, cls=cls)


def parse_recipe_yaml(text: str, *, source: str = "<string>", cls: type[R] = RecipeSpec) -> R:  # type: ignore[assignment]
    """A recipe from YAML text (``extends:`` relative to the current directory is refused: there is no file)."""
    return resolve_recipe(_parse_yaml(text, source), source=source, cls=cls)
