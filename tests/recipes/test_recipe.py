"""Recipe schema: shipped recipes, round trips, extends, and one clear problem line per mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from hf_mixedprec.integrations.recipe import Recipe, RecipeError, builtin_recipe_names, load_recipe_file, resolve_recipe
from hf_mixedprec.recipes.schema import RecipeSpec

SHIPPED = {
    "cpu-bf16",
    "cpu-fp32",
    "v100-fp16",
    "t4-fp16",
    "a100-bf16",
    "ada-fp8-current",
    "h100-fp8-delayed",
    "h100-fp8-current",
    "h100-fp8-blockwise",
    "b200-mxfp8",
    "b200-nvfp4",
    "h100-fp8-anneal-bf16",
}


def test_all_twelve_recipes_ship():
    assert set(builtin_recipe_names()) == SHIPPED


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_recipe_round_trips_through_yaml(name):
    r = load_recipe_file(name)
    again = Recipe.from_yaml(r.to_yaml())
    assert again == r
    assert again.to_yaml() == r.to_yaml()


def test_shipped_values():
    d = load_recipe_file("h100-fp8-delayed")
    assert (d.fp8.scaling, d.fp8.format, d.fp8.amax_history_len, d.fp8.amax_compute_algo, d.fp8.margin) == (
        "delayed",
        "HYBRID",
        1024,
        "max",
        0,
    )
    assert d.fp8.epsilon is None and d.fp8.mx_rounding is None  # options of other scalings
    v = load_recipe_file("v100-fp16")
    assert v.loss_scale.init_scale == 65536.0 and v.loss_scale.growth_interval == 2000
    assert v.fp8 is None and v.tf32 is False
    m = load_recipe_file("b200-mxfp8")
    assert (m.fp8.scaling, m.fp8.mx_rounding, m.fp8.block_size, m.fp8.format) == ("mxfp8", "rceil", 32, "E4M3")
    assert m.fp8.amax_history_len is None
    b = load_recipe_file("h100-fp8-blockwise")
    assert (b.fp8.block_size, b.fp8.power_2_scales) == (128, True)


def test_extends_inherits_and_overrides():
    t4 = load_recipe_file("t4-fp16")
    v100 = load_recipe_file("v100-fp16")
    assert t4.hardware == ("turing",) and v100.hardware == ("volta",)
    assert t4.loss_scale == v100.loss_scale
    cur = load_recipe_file("h100-fp8-current")
    assert cur.fp8 == load_recipe_file("ada-fp8-current").fp8
    assert cur.extends is None  # resolved recipes carry their values, not the link


def test_recipe_is_immutable():
    r = load_recipe_file("cpu-bf16")
    with pytest.raises(ValidationError, match="frozen"):
        r.precision = "fp16"  # type: ignore[misc]


@pytest.mark.parametrize("how", [{"exclude_defaults": True}, {"exclude_unset": True}, {"exclude_none": True}, {}])
def test_a_dumped_section_of_another_kind_than_the_default_reloads_as_that_kind(how):
    recipe = RecipeSpec.model_validate(
        {
            "name": "x",
            "precision": "fp8",
            "fp8": {"scaling": "mxfp8", "backend": "emulated"},
            "clipping": {"method": "none"},
        }
    )
    dumped = recipe.model_dump(**how)
    assert dumped["fp8"]["scaling"] == "mxfp8" and dumped["clipping"]["method"] == "none"
    assert RecipeSpec.model_validate(dumped) == recipe


def test_json_schema_names_every_section():
    schema = Recipe.json_schema()
    assert {"name", "precision", "tf32", "loss_scale", "fp8", "clipping", "health", "distributed"} <= set(
        schema["properties"]
    )
    # fp8 is one of four models by scaling, each with only its own keys; together they hold every key
    kinds = [ref["$ref"].rsplit("/", 1)[1] for ref in schema["properties"]["fp8"]["anyOf"][0]["oneOf"]]
    assert kinds == ["DelayedFP8Config", "CurrentFP8Config", "MXFP8Config", "BlockwiseFP8Config", "NVFP4Config"]
    fp8 = {key for kind in kinds for key in schema["$defs"][kind]["properties"]}
    for key in (
        "backend",
        "scaling",
        "format",
        "amax_history_len",
        "amax_compute_algo",
        "margin",
        "epsilon",
        "power_2_scales",
        "mx_rounding",
        "block_size",
        "align",
    ):
        assert key in fp8, key
    # another kind's key is allowed only as null (a recipe extending another removes one so); the selector is
    # required except for the default kind, so exactly one kind matches any section (oneOf holds)
    assert schema["$defs"]["DelayedFP8Config"]["properties"]["epsilon"] == {"type": "null"}
    assert schema["$defs"]["CurrentFP8Config"]["properties"]["margin"] == {"type": "null"}
    assert schema["$defs"]["CurrentFP8Config"]["properties"]["scaling"]["const"] == "current"
    for kind, required in (("DelayedFP8Config", False), ("CurrentFP8Config", True), ("MXFP8Config", True)):
        assert ("scaling" in schema["$defs"][kind].get("required", [])) is required, kind
    for kind, required in (("ZClipConfig", False), ("NormClipConfig", True), ("NoClipConfig", True)):
        assert ("method" in schema["$defs"][kind].get("required", [])) is required, kind
    clipping = [ref["$ref"].rsplit("/", 1)[1] for ref in schema["properties"]["clipping"]["oneOf"]]
    assert clipping == ["NoClipConfig", "NormClipConfig", "ZClipConfig", "AutoClipConfig", "AGCConfig"]
    rule = schema["$defs"]["ModuleRule"]["properties"]
    assert {"match", "class", "select", "first_blocks", "last_blocks", "compute", "fp8", "storage"} <= set(rule)
    ls = schema["$defs"]["LossScaleConfig"]["properties"]
    assert set(ls) == {
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "min_scale",
        "max_scale",
        "hysteresis",
    }
    json.dumps(schema)


def _problems(data, source="x.yaml"):
    with pytest.raises(RecipeError) as exc:
        resolve_recipe(data, source=source)
    return [str(p) for p in exc.value.problems]


BASE = {"name": "t", "precision": "fp8", "fp8": {"scaling": "delayed"}}


@pytest.mark.parametrize(
    "patch, expected",
    [
        (
            {"precison": "bf16"},
            "x.yaml: precison: unknown key (allowed: name, description, extends, hardware, precision",
        ),
        ({"fp8": {"scaling": "delayed", "amax_history_length": 10}}, "x.yaml: fp8.amax_history_length: unknown key"),
        ({"precision": "fp12"}, "x.yaml: precision: 'fp12' is not allowed (allowed: fp32, fp16, bf16, fp8)"),
        (
            {"fp8": {"scaling": "delayed", "amax_history_len": 0}},
            "x.yaml: fp8.amax_history_len: 0 is out of range (allowed: >= 1)",
        ),
        ({"fp8": {"scaling": "delayed", "amax_history_len": "long"}}, "x.yaml: fp8.amax_history_len: "),
        ({"fp8": {"scaling": "delayed", "format": "E5M2"}}, "x.yaml: fp8.format: pure E5M2 training is refused"),
        (
            {"fp8": {"scaling": "mxfp8", "amax_history_len": 16}},
            "x.yaml: fp8.amax_history_len: does not apply to scaling 'mxfp8' (it applies to: delayed)",
        ),
        (
            {"fp8": {"scaling": "current", "mx_rounding": "floor"}},
            "x.yaml: fp8.mx_rounding: does not apply to scaling 'current'",
        ),
        (
            {"fp8": {"scaling": "mxfp8", "block_size": 16}},
            "x.yaml: fp8.block_size: 16 is not supported for mxfp8 (allowed: 32)",
        ),
        (
            {"fp8": {"scaling": "wavelet"}},
            "x.yaml: fp8.scaling: 'wavelet' is not allowed (allowed: delayed, current, mxfp8, blockwise, nvfp4)",
        ),
        ({"fp8": {"scaling": "delayed", "margin": -1}}, "x.yaml: fp8.margin: -1 is out of range (allowed: >= 0)"),
        (
            {"fp8": {"scaling": "delayed", "backend": "msamp"}},
            "x.yaml: fp8.backend: 'msamp' is not allowed (allowed: auto, transformer_engine, torchao, native, emulated)",
        ),
        ({"precision": "bf16"}, "x.yaml: fp8: only applies to precision fp8 (precision is bf16); remove it"),
        ({"precision": "bf16", "fp8": None, "loss_scale": {}}, "x.yaml: loss_scale: only applies to precision fp16"),
        ({"hardware": ["hopper", "pascal"]}, "x.yaml: hardware.1: 'pascal' is not allowed (allowed: cpu, mps, volta"),
        (
            {"clipping": {"method": "zclip", "percentile": 5}},
            "x.yaml: clipping.percentile: does not apply to method 'zclip' (it applies to: autoclip)",
        ),
        ({"clipping": {"method": "zclip", "alpha": 1.5}}, "x.yaml: clipping.alpha: 1.5 is out of range (allowed: < 1)"),
        (
            {"distributed": {"strategy": "ddp", "zero_stage": 2}},
            "x.yaml: distributed.zero_stage: only applies to strategy deepspeed",
        ),
        (
            {"distributed": {"strategy": "horovod"}},
            "x.yaml: distributed.strategy: 'horovod' is not allowed (allowed: none, ddp, fsdp2, deepspeed)",
        ),
        (
            {"health": {"detectors": {"loss_spike": {"reaction": "panic"}}}},
            "x.yaml: health.detectors.loss_spike.reaction: 'panic' is not allowed (allowed: log, warn, skip_step, stop, fallback, lower_lr)",
        ),
        (
            {"health": {"detectors": {"loss_spike": {"reaction": "lower_lr"}}}},
            "x.yaml: health.detectors.loss_spike.lr_factor: is required when reaction is lower_lr",
        ),
        (
            {"health": {"detectors": {"cosmic_ray": {}}}},
            "x.yaml: health.detectors.cosmic_ray: unknown key (allowed: nonfinite_loss,",
        ),
        ({"fp8": "yes"}, "x.yaml: fp8: expected a mapping, got 'yes'"),
        ({"name": "has space"}, "x.yaml: name: 'has space' is not a valid name"),
    ],
)
def test_each_mistake_is_one_line_naming_the_dotted_key(patch, expected):
    data = {**BASE, **patch}
    problems = _problems(data)
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems[0]


def test_several_mistakes_give_several_lines():
    problems = _problems(
        {"name": "t", "precision": "fp16", "tf32": "maybe", "loss_scale": {"growth_interval": 0}, "oops": 1}
    )
    keys = sorted(p.split(": ")[1] for p in problems)
    assert keys == ["loss_scale.growth_interval", "oops", "tf32"]


def test_missing_required_keys():
    assert _problems({"description": "x"}) == ["x.yaml: name: is required", "x.yaml: precision: is required"]


def test_deepspeed_rules():
    problems = _problems(
        {
            "name": "t",
            "precision": "fp16",
            "loss_scale": {"init_scale": 1000.0},
            "distributed": {"strategy": "deepspeed"},
        }
    )
    assert problems == [
        "x.yaml: loss_scale.init_scale: 1000 must be a power of two with DeepSpeed (initial_scale_power)"
    ]
    r = resolve_recipe({"name": "t", "precision": "fp16", "distributed": {"strategy": "deepspeed"}})
    assert r.distributed.zero_stage == 1


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_extends_by_relative_path_and_null_removes(tmp_path):
    _write(tmp_path, "base.yaml", "name: base\nprecision: fp8\nfp8: {scaling: delayed, amax_history_len: 16}\n")
    child = _write(
        tmp_path, "child.yaml", "name: child\nextends: base.yaml\nfp8: {scaling: mxfp8, amax_history_len: null}\n"
    )
    r = load_recipe_file(child)
    assert r.fp8.scaling == "mxfp8" and r.fp8.amax_history_len is None and r.fp8.block_size == 32
    # switching the scaling drops the parent's delayed-only options without a null
    switched = _write(tmp_path, "switched.yaml", "name: s\nextends: base.yaml\nfp8: {scaling: mxfp8}\n")
    assert load_recipe_file(switched).fp8.amax_history_len is None
    bad = _write(tmp_path, "bad.yaml", "name: bad\nextends: base.yaml\nfp8: {scaling: mxfp8, amax_history_len: 16}\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe_file(bad)
    assert [str(p) for p in exc.value.problems] == [
        f"{bad}: fp8.amax_history_len: does not apply to scaling 'mxfp8' (it applies to: delayed); remove it (set it to null in a recipe that extends another)"
    ]


def test_extends_cycle_and_missing(tmp_path):
    a = _write(tmp_path, "a.yaml", "name: a\nextends: b.yaml\nprecision: bf16\n")
    _write(tmp_path, "b.yaml", "name: b\nextends: a.yaml\nprecision: bf16\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe_file(a)
    (p,) = exc.value.problems
    assert p.key == "extends" and "cycle:" in p.message and p.message.count("a.yaml") == 2
    m = _write(tmp_path, "m.yaml", "name: m\nextends: no-such-recipe\nprecision: bf16\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe_file(m)
    assert str(exc.value).startswith(
        f"{m}: extends: 'no-such-recipe': no such recipe (allowed: a YAML path or one of: auto, a100-bf16"
    )
    s = _write(tmp_path, "s.yaml", "name: s\nextends: s.yaml\nprecision: bf16\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe_file(s)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: [unclosed\n", "invalid YAML: line 2, column 1"),
        ("", "the document is empty"),
        ("# only a comment\n", "the document is empty"),
        ("- a\n- b\n", "expected a mapping at the top level, got list"),
        ("just a string\n", "expected a mapping at the top level, got str"),
        ("name: x\nprecision: !!python/object/apply:os.system ['touch /tmp/hf_mp_pwned']\n", "refused YAML tag"),
        ("1: x\nprecision: bf16\n", "keys must be strings"),
    ],
)
def test_broken_yaml_documents(tmp_path, text, expected):
    p = _write(tmp_path, "r.yaml", text)
    with pytest.raises(RecipeError) as exc:
        load_recipe_file(p)
    assert len(exc.value.problems) == 1
    assert expected in str(exc.value), str(exc.value)
    assert not Path("/tmp/hf_mp_pwned").exists()


def test_yaml_round_trip_of_custom_recipe():
    r = resolve_recipe(
        {
            "name": "custom",
            "precision": "fp8",
            "fp8": {"scaling": "current", "keep_in_bf16": ["*.mlp.*"], "epsilon": 1e-12},
        }
    )
    text = r.to_yaml()
    data = yaml.safe_load(text)
    assert "keep_in_bf16" not in data["fp8"]  # an old key, read as the module rule it means
    assert data["modules"][0] == {"name": "keep_in_bf16", "match": ["*.mlp.*"], "fp8": False, "required": False}
    assert r.legacy_notes and "fp8.keep_in_bf16 is now a module rule" in r.legacy_notes[0]
    again = Recipe.from_yaml(text)
    assert again.to_dict() == r.to_dict() and again.modules == r.modules and not again.legacy_notes


def test_switching_method_or_scaling_in_a_child_drops_the_old_options():
    from hf_mixedprec.integrations.recipe import resolve_recipe

    r = resolve_recipe({"name": "c", "extends": "cpu-bf16", "clipping": {"method": "norm", "max_norm": 0.5}})
    assert r.clipping.method == "norm" and r.clipping.params() == {"max_norm": 0.5}
    r = resolve_recipe({"name": "m", "extends": "h100-fp8-delayed", "fp8": {"scaling": "current"}})
    assert r.fp8.scaling == "current" and r.fp8.amax_history_len is None
    assert r.fp8.align == 16 and r.modules == load_recipe_file("h100-fp8-delayed").modules  # common options stay


# -- fp8 and clipping come in kinds: one model per scaling / method -------------------------------------------------


def test_each_kind_has_only_its_own_options():
    from hf_mixedprec.core.formats import FP8_SCALING_DEFAULTS
    from hf_mixedprec.recipes.schema import CLIP_DEFAULTS, ClippingConfig, FP8Config

    for scaling, defaults in FP8_SCALING_DEFAULTS.items():
        cfg = FP8Config(scaling=scaling)
        assert isinstance(cfg, FP8Config) and type(cfg) is FP8Config.KINDS[scaling]
        assert cfg.options() == defaults
        kind_only = set(type(cfg).model_fields) - {"backend", "scaling", "format", "align", "torchao_recipe"}
        assert kind_only == set(defaults), scaling
        # a dump keeps the flat shape: every key, null where it does not apply
        assert list(cfg.model_dump()) == list(FP8Config.SECTION_KEYS)
    for method, defaults in CLIP_DEFAULTS.items():
        cfg = ClippingConfig(method=method)
        assert isinstance(cfg, ClippingConfig) and type(cfg) is ClippingConfig.KINDS[method]
        assert cfg.params() == defaults and set(type(cfg).model_fields) == {"method", *defaults}
    assert type(ClippingConfig()).__name__ == "ZClipConfig" and type(FP8Config()).__name__ == "DelayedFP8Config"


_FP8_CASES = [
    (
        {"scaling": "current", "margin": 2},
        "margin: does not apply to scaling 'current' (it applies to: delayed, mxfp8); remove it (set it to null "
        "in a recipe that extends another)",
    ),
    (
        {"scaling": "mxfp8", "amax_history_len": 16},
        "amax_history_len: does not apply to scaling 'mxfp8' (it applies to: delayed); remove it",
    ),
    ({"epsilon": 0.5}, "epsilon: does not apply to scaling 'delayed' (it applies to: current); remove it"),
    (
        {"scaling": "current", "torchao_recipe": "rowwise"},
        "torchao_recipe: only applies to backend torchao (backend is 'auto'); remove it",
    ),
    (
        {"scaling": "mxfp8", "backend": "torchao"},
        "scaling: 'mxfp8' is not available with backend torchao (allowed: current;",
    ),
    ({"scaling": "blockwise", "block_size": 32}, "block_size: 32 is not supported for blockwise (allowed: 128)"),
]
_CLIPPING_CASES = [
    ({"method": "norm", "alpha": 0.5}, "alpha: does not apply to method 'norm' (it applies to: zclip); remove it"),
    ({"method": "none", "max_norm": 1.0}, "max_norm: does not apply to method 'none' (it applies to: norm, zclip)"),
    ({"percentile": 5.0}, "percentile: does not apply to method 'zclip' (it applies to: autoclip); remove it"),
    ({"method": "agc", "history_size": 10}, "history_size: does not apply to method 'agc' (it applies to: autoclip)"),
]


@pytest.mark.parametrize(
    "section, data, expected",
    [("fp8", d, e) for d, e in _FP8_CASES] + [("clipping", d, e) for d, e in _CLIPPING_CASES],
)
def test_an_option_of_another_kind_cannot_be_built_from_python(section, data, expected):
    """Whichever way a section is built (the family, its model_validate, the kind itself, a recipe, a recipe file),
    another kind's option is refused with the same message."""
    from hf_mixedprec.recipes.schema import ClippingConfig, FP8Config, RecipeSpec

    family, precision = (FP8Config, "fp8") if section == "fp8" else (ClippingConfig, "bf16")
    default = family.model_fields[family.SELECTOR].default
    kind = family.KINDS[data.get(family.SELECTOR, default)]
    for build in (lambda: family(**data), lambda: family.model_validate(data), lambda: kind(**data)):
        with pytest.raises(ValidationError) as exc:
            build()
        assert expected in str(exc.value)
    recipe = {"name": "t", "precision": precision, section: data}
    with pytest.raises(ValidationError) as exc:
        RecipeSpec.model_validate(recipe)
    assert expected in str(exc.value)
    problems = _problems(recipe)
    assert len(problems) == 1 and problems[0].startswith(f"x.yaml: {section}.{expected}"), problems


def test_a_kind_named_directly_takes_only_its_own_selector():
    from hf_mixedprec.recipes.schema import DelayedFP8Config, NormClipConfig

    with pytest.raises(ValidationError, match="Input should be 'delayed'"):
        DelayedFP8Config(scaling="current")
    with pytest.raises(ValidationError, match="Input should be 'norm'"):
        NormClipConfig(method="zclip")


def test_null_options_of_another_kind_are_dropped_and_dumps_round_trip():
    from hf_mixedprec.recipes.schema import ClippingConfig, FP8Config

    cfg = FP8Config(scaling="current", amax_history_len=None, margin=None, epsilon=None)
    assert cfg == FP8Config(scaling="current") and cfg.epsilon == 0.0  # a null own option takes its default
    for name in builtin_recipe_names():
        r = load_recipe_file(name)
        assert Recipe.model_validate(r.model_dump()) == r  # the flat dump (nulls of other kinds) validates again
        if r.fp8 is not None:
            assert FP8Config.model_validate(r.fp8.model_dump()) == r.fp8
    assert ClippingConfig(method="autoclip", history_size=None).history_size is None  # AutoClip keeps every norm


def test_an_unknown_selector_still_lists_every_problem_of_the_section():
    problems = _problems({"name": "t", "precision": "fp8", "fp8": {"scaling": "wavelet", "align": 0, "margin": -1}})
    assert problems == [
        "x.yaml: fp8.scaling: 'wavelet' is not allowed (allowed: delayed, current, mxfp8, blockwise, nvfp4)",
        "x.yaml: fp8.margin: -1 is out of range (allowed: >= 0)",
        "x.yaml: fp8.align: 0 is out of range (allowed: >= 1)",
    ]
    assert _problems({"name": "t", "precision": "bf16", "clipping": {"method": ["norm"]}}) == [
        "x.yaml: clipping.method: ['norm'] is not allowed (allowed: none, norm, zclip, autoclip, agc)"
    ]


def test_keys_shared_by_kinds_are_declared_alike():
    """The reference documents each key once (scripts/gen_recipe_docs.py): every kind that has it agrees on its type,
    bounds and meaning."""
    from hf_mixedprec.recipes.schema import ClippingConfig, FP8Config

    for family in (FP8Config, ClippingConfig):
        for key in family.SECTION_KEYS:
            fields = [k.model_fields[key] for k in family.KINDS.values() if key in k.model_fields]
            assert fields, key
            if key != family.SELECTOR:
                assert len({(repr(f.annotation), repr(f.metadata), f.description) for f in fields}) == 1, key
        for kind in family.KINDS.values():  # each kind's keys in the section's order
            keys = list(kind.model_fields)
            assert keys == [k for k in family.SECTION_KEYS if k in keys], kind


def test_a_family_base_validates_json_as_the_kind_it_names():
    from hf_mixedprec.recipes.schema import ClippingConfig, CurrentFP8Config, FP8Config, NormClipConfig

    fp8 = FP8Config.model_validate_json('{"scaling": "current", "epsilon": 0.0}')
    assert isinstance(fp8, CurrentFP8Config) and fp8.options()["epsilon"] == 0.0
    clip = ClippingConfig.model_validate_json('{"method": "norm", "max_norm": 2.0}')
    assert isinstance(clip, NormClipConfig) and clip.params() == {"max_norm": 2.0}
    with pytest.raises(ValidationError, match="does not apply to scaling 'current'"):
        FP8Config.model_validate_json('{"scaling": "current", "margin": 2}')
    with pytest.raises(ValidationError, match="Invalid JSON"):
        FP8Config.model_validate_json("{not json")


def test_another_kinds_option_reads_none_as_the_flat_section_held_it():
    """Reading is not writing: ``recipe.fp8.margin`` on current scaling, or ``recipe.clipping.percentile`` under zclip,
    is None, as it was before sections came in kinds; a name no kind has still raises AttributeError."""
    from hf_mixedprec.recipes.schema import ClippingConfig, FP8Config

    seen = 0
    for name in builtin_recipe_names():
        r = load_recipe_file(name)
        for section in (r.fp8, r.clipping):
            if section is None:
                continue
            flat = section.model_dump()  # the flat shape: other kinds' keys as null
            for key in type(section).SECTION_KEYS:
                assert getattr(section, key) == flat[key], (name, key)
                seen += key not in type(section).model_fields
    assert seen > 20  # other kinds' keys were read, not only own fields
    with pytest.raises(AttributeError, match="no_such_option"):
        FP8Config(scaling="current").no_such_option  # noqa: B018
    with pytest.raises(AttributeError):
        ClippingConfig(method="norm").nope  # noqa: B018


def test_model_copy_that_names_another_kind_builds_that_kind():
    """``section.model_copy(update={"scaling": "delayed"})`` is a validated delayed section keeping the options both
    kinds have (pydantic alone would keep the current-scaling class holding scaling 'delayed'); a bad kind is refused
    with the allowed values, and an update within the kind is pydantic's copy."""
    from hf_mixedprec.recipes.schema import DelayedFP8Config, FP8Config, NormClipConfig

    current = FP8Config(scaling="current", backend="emulated", epsilon=1e-6)
    delayed = current.model_copy(update={"scaling": "delayed", "margin": 1})
    assert type(delayed) is DelayedFP8Config and delayed == FP8Config(scaling="delayed", backend="emulated", margin=1)
    assert delayed.epsilon is None  # current's own option is not carried into delayed
    with pytest.raises(ValidationError, match="'delayed', 'current', 'mxfp8', 'blockwise' or 'nvfp4'"):
        current.model_copy(update={"scaling": "bogus"})
    same = current.model_copy(update={"backend": "torchao"})
    assert type(same) is type(current) and same.backend == "torchao" and same.epsilon == 1e-6
    clip = load_recipe_file("cpu-bf16").clipping.model_copy(update={"method": "norm", "max_norm": 2.0})
    assert type(clip) is NormClipConfig and clip.params() == {"max_norm": 2.0}
