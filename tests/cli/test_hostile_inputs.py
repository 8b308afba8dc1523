"""Every input checked where it enters: environment variables, output folders, data files, health.json and estimate
configs that nobody here wrote. Each mistake is one line naming the variable, flag or key, exit 2, no traceback, and
nothing trained or written before it."""

from __future__ import annotations

import pytest

from hf_mixedprec.cli.app import main

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err[-2000:]
    lines = err.splitlines()
    assert len(lines) == 1, err[-2000:]
    return lines[0]


# -- environment ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env,said",
    [
        ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not a process count or index"),
        ({"LOCAL_RANK": "\u00b2"}, "LOCAL_RANK='\u00b2' is not a process count or index"),
        ({"RANK": "-1"}, "RANK='-1' is not a process count or index"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is not a rank of WORLD_SIZE=2 (allowed: 0 to 1)"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is not a world"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port (allowed: 1 to 65535)"),
        ({"ACCELERATE_MIXED_PRECISION": "fp17"}, "ACCELERATE_MIXED_PRECISION='fp17' is not a precision Accelerate"),
        ({"HF_MIXEDPREC_RECIPE": "/no/such/run.yaml"}, "HF_MIXEDPREC_RECIPE=/no/such/run.yaml: file not found"),
        ({"HF_MIXEDPREC_REHEARSE": "maybe"}, "HF_MIXEDPREC_REHEARSE='maybe' is not a boolean"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_a_bad_environment_variable_is_one_line_naming_it(env, said, tmp_path, capsys, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    line = _refused(["finetune", "--max-steps", "2", "--output-dir", str(out)], capsys)
    assert said in line
    assert not out.exists()  # nothing prepared, nothing written


def test_the_trainer_refuses_an_unknown_accelerate_mixed_precision_and_says_when_the_recipe_replaces_it(
    tmp_path, monkeypatch
):
    from transformers import Trainer

    from hf_mixedprec.core.demo import tiny_llama
    from hf_mixedprec.integrations.recipe import load_recipe, resolve_recipe
    from hf_mixedprec.integrations.trainer import runtime_of
    from tests.integrations.test_integration import Bytes

    def build(recipe):
        args = recipe.training_args(output_dir=str(tmp_path), max_steps=1, report_to=[])
        return Trainer(model=tiny_llama(), args=args, train_dataset=Bytes(), callbacks=recipe.callbacks())

    bf16 = load_recipe("cpu-bf16")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp17")  # it was dropped without a word
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION='fp17' is not a precision Accelerate knows"):
        build(bf16)
    # `accelerate launch` without a config exports 'no': TrainingArguments' bf16=True wins, nothing to say
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    trainer = build(bf16)
    assert trainer.accelerator.mixed_precision == "bf16" and not any(
        "ACCELERATE" in n for n in runtime_of(trainer).notes
    )
    # an FP32 recipe sets neither flag, so the variable became mixed_precision: replaced, and said
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    trainer = build(resolve_recipe({"name": "f32", "extends": "cpu-bf16", "precision": "fp32"}))
    assert trainer.accelerator.mixed_precision == "no"
    assert "ACCELERATE_MIXED_PRECISION='bf16' is replaced by recipe 'f32''s precision (mixed_precision='no')" in (
        runtime_of(trainer).notes
    )


# -- output folders ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["finetune", "compare"])
def test_an_output_folder_that_is_a_dangling_link_is_refused_before_any_work(command, tmp_path, capsys):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone" / "deeper")
    args = ["--recipes", "cpu-bf16"] if command == "compare" else []
    line = _refused([command, *args, "--max-steps", "2", "--output-dir", str(link)], capsys)
    assert f"--output-dir: {str(link)!r} is a symbolic link to" in line and "which does not exist" in line
    assert not (tmp_path / "gone").exists()


# -- health.json, as `report` reads it ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content,said",
    [
        ('{"version":1,"series":{"loss":{"1":"abc"}}}', "field 'series.loss' at step 1: 'abc' is not a number"),
        ('{"version":1,"series":{"loss":{"-1":1.0}}}', "field 'series.loss' is not a mapping of step -> value"),
        ('{"version":1,"series":{"loss":{"99999999999":1}}}', "(allowed: steps 0 to 1,000,000,000)"),
        ('{"version":1,"series":{},"events":[{"step":"a"}]}', "field 'events.0.step' is 'a'"),
        ('{"version":1,"series":{},"events":[{"step":1,"layer":[1]}]}', "field 'events.0.layer' is a list"),
        ("[" * 100_000 + "]" * 100_000, "is nested too deeply to be a health report"),
        (b"\xff\xfe{}", "is not UTF-8 text (byte 0)"),
    ],
    ids=["string-value", "negative-step", "absurd-step", "event-step", "event-layer", "deep", "not-utf8"],
)
def test_report_checks_every_value_of_health_json(content, said, tmp_path, capsys):
    path = tmp_path / "health.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert said in _refused(["report", str(tmp_path)], capsys)
    assert not list(tmp_path.glob("*.png"))


def test_report_refuses_a_health_json_too_big_to_be_one_without_reading_it(tmp_path, capsys, monkeypatch):
    import hf_mixedprec.cli.inspect_cmds as cli_inspect  # report's module, where cmd_report reads the limit

    monkeypatch.setattr(cli_inspect, "MAX_HEALTH_BYTES", 1000)
    (tmp_path / "health.json").write_text('{"version": 1, "series": {}, "notes": ["' + "x" * 2000 + '"]}')
    assert "(allowed: at most 0 MiB" in _refused(["report", str(tmp_path)], capsys)


def test_report_still_reads_what_a_run_writes_inf_nan_and_null_included(tmp_path, capsys):
    (tmp_path / "health.json").write_text('{"version":1,"series":{"loss":{"1":"inf","2":null,"3":"nan","4":2.5}}}')
    assert main(["report", str(tmp_path)]) == 0


# -- estimate configs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,said",
    [
        ({"hidden_size": -5}, "hidden_size -5 is not a size (allowed: an integer >= 1, or a list"),
        ({"hidden_size": "64"}, "hidden_size '64' is not a size"),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers 1,000,000 is more layers than estimate and plan build"),
        ({"text_config": {"vocab_size": 0}}, "text_config.vocab_size 0 is not a size"),
        ({"intermediate_size": [256, -1]}, "intermediate_size [256, -1] is not a size"),
        ({"RANK-like": 0, "hidden_size": 64, "num_hidden_layers": "²"}, "num_hidden_layers '²' is not a size"),
    ],
    ids=["negative", "string", "huge-layer-count", "nested", "per-layer-list", "unicode-digit"],
)
def test_estimate_refuses_a_config_size_naming_the_file_and_key_in_bounded_time(change, said, tmp_path, capsys):
    import json
    import time
    from pathlib import Path

    base = json.loads((Path(__file__).parents[2] / "examples/model_configs/tiny-llama/config.json").read_text())
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**base, **change}))
    start = time.perf_counter()
    line = _refused(["estimate", "--recipes", "cpu-bf16", "--config", str(cfg), "--seq-len", "64"], capsys)
    assert f"--config: {str(cfg)!r}: {said}" in line and time.perf_counter() - start < 10


# -- data files -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,content,where",
    [
        ("bad.jsonl", b'{"text": "hello world"}\n{"text": "caf\xe9"}\n', "byte 37 (line 2) is 0xe9"),
        ("bad.txt", b"hello\n\ncaf\xe9 au lait\n", "byte 10 (line 3) is 0xe9"),
        ("bad.csv", b"text\nfine\n\xff\xfe\n", "byte 10 (line 3) is 0xff"),
        ("cut.txt", "hello \u00e9".encode()[:-1], "it ends inside a character"),
    ],
    ids=["jsonl", "txt", "csv", "truncated"],
)
def test_data_that_is_not_utf8_is_one_line_naming_where(name, content, where, tmp_path, capsys):
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "run"
    line = _refused(["finetune", "--data", str(data), "--max-steps", "2", "--output-dir", str(out)], capsys)
    assert f"--data: {str(data)!r} is not UTF-8 text" in line and where in line
    assert not out.exists()


def test_one_very_long_example_is_tokenized_in_bounded_pieces_losing_no_text():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import hf_mixedprec.commands.workload as ft

    words = ["alpha", "beta", "gamma", "delta"]
    long = " ".join(words[i % 4] for i in range(200_000))  # about 1.1 M characters, one example
    pieces = list(ft._pieces(long))
    assert "".join(pieces) == long and len(pieces) > 10
    assert max(map(len, pieces)) <= ft.MAX_PIECE_CHARS
    assert all(p.startswith(" ") for p in pieces[1:])  # each cut falls on whitespace, never inside a word

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "</s>", *words])}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="[UNK]")
    seen: list[int] = []
    inner = tok.__call__

    def counting(texts, **kw):
        seen.append(sum(map(len, texts)))
        return inner(texts, **kw)

    blocks, n_tokens = ft.pack_blocks(["alpha beta", long], _Calls(tok, counting), seq_len=8)
    assert n_tokens == 2 + 1 + 200_000 + 1  # every word of both examples, one EOS after each
    assert max(seen) <= ft._BATCH_CHARS + ft.MAX_PIECE_CHARS
    flat = blocks.blocks.flatten().tolist()
    assert flat[:3] == [2, 3, 1] and flat.count(1) == 1  # one EOS ends the short example; the long one's is cut off


class _Calls:
    """A tokenizer whose calls go through ``fn`` (PreTrainedTokenizerFast's ``__call__`` is looked up on the class)."""

    def __init__(self, tok, fn):
        self._tok, self._fn = tok, fn
        self.eos_token_id = tok.eos_token_id

    def __call__(self, texts, **kw):
        return self._fn(texts, **kw)


# -- every subcommand -------------------------------------------------------------------------------------------------
def _hostile_cases(tmp) -> list[tuple[str, list[str], dict[str, str], str]]:
    """(case, argv, environment, what the one line says): at least one hostile input of each kind for each
    subcommand, files made in ``tmp``."""
    import json
    from pathlib import Path

    base = json.loads((Path(__file__).parents[2] / "examples/model_configs/tiny-llama/config.json").read_text())
    huge = tmp / "huge.json"
    huge.write_text(json.dumps({**base, "num_hidden_layers": 10**6}))
    deep = tmp / "deep.yaml"
    deep.write_text("name: x\nextends: " + "[" * 100 + "]" * 100 + "\n")
    latin = tmp / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    health = tmp / "run"
    health.mkdir()
    (health / "health.json").write_text('{"version":1,"series":{"loss":{"1":"x"}}}')
    link = tmp / "dangling"
    link.symlink_to(tmp / "nowhere")
    bad_env = {"LOCAL_RANK": "abc"}
    return [
        ("recipes-env", ["recipes"], bad_env, "LOCAL_RANK='abc'"),
        ("schema-env", ["schema"], {"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a port"),
        ("detect-env", ["detect"], {"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not a rank of WORLD_SIZE=2"),
        ("show-missing", ["show", str(tmp / "none.yaml")], {}, "file not found"),
        ("validate-deep", ["validate", str(deep)], {}, "nested deeper than"),
        ("launch-count", ["launch", "--recipe", "cpu-bf16", "--num-processes", "0", "x.py"], {}, "--num-processes"),
        ("simulate-steps", ["simulate", "--recipe", "h100-fp8-delayed", "--steps", "-3"], {}, "--steps: -3"),
        ("finetune-data", ["finetune", "--data", str(latin), "--output-dir", str(tmp / "o1")], {}, "not UTF-8"),
        ("compare-link", ["compare", "--recipes", "cpu-bf16", "--output-dir", str(link)], {}, "symbolic link"),
        ("estimate-layers", ["estimate", "--recipes", "cpu-bf16", "--config", str(huge)], {}, "more layers"),
        ("plan-layers", ["plan", "--recipe", "cpu-bf16", "--config", str(huge)], {}, "more layers"),
        ("report-value", ["report", str(health)], {}, "is not a number"),
        ("finetune-recipe-env", ["finetune", "--output-dir", str(tmp / "o2")], {"HF_MIXEDPREC_RECIPE": "/x.yaml"}, "HF_MIXEDPREC_RECIPE=/x.yaml"),
    ]  # fmt: skip


def test_every_subcommand_answers_hostile_input_in_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    from hf_mixedprec.cli.app import build_parser

    cases = _hostile_cases(tmp_path)
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert {argv[0] for _, argv, _, _ in cases} == commands  # every subcommand has a case
    for case, argv, env, said in cases:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and "Traceback" not in err, (case, err[-1500:])
        assert said in err.splitlines()[-1], (case, err[-1500:])


@pytest.mark.parametrize(
    "content,where",
    [(b"abcdef\xc3\xa9\xffxyz", "byte 8 (line 1) is 0xff"), (b"abcdefg\xc3\xffxyz", "byte 7 (line 1) is 0xc3")],
    ids=["after-a-character-cut-by-the-read", "inside-it"],
)
def test_the_utf8_check_names_the_right_byte_across_its_reads(content, where, tmp_path, monkeypatch):
    import hf_mixedprec.commands.workload as ft
    from hf_mixedprec.core.errors import UsageError

    monkeypatch.setattr(ft, "_UTF8_CHUNK", 8)  # reads of 8 bytes: the two-byte character spans two of them
    data = tmp_path / "x.txt"
    data.write_bytes(content)
    with pytest.raises(UsageError, match=where.replace("(", r"\(").replace(")", r"\)")):
        ft.check_utf8(str(data))
