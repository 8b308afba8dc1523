"""The workload ``finetune`` and ``compare`` share: the data, the tokenizer, the model, the packed blocks, the run's
numbers, how often a short run samples FP8 statistics, and the memory it may use.

- **Data** (``--data``; :func:`load_texts`): a ``.txt``/``.text``/``.md`` file, one example per paragraph
  (paragraphs are separated by a blank line, i.e. ``"\\n\\n"``; a file with no blank line is one example);
  a ``.jsonl``/``.json`` file (JSON lines or a JSON array of objects), a ``.csv`` or a ``.parquet`` file with a
  text column (``--text-field``, default ``text``); or a folder written by ``datasets``' ``save_to_disk``
  (a ``DatasetDict`` gives its ``train`` split). All of them are read with ``datasets``. Examples whose text
  is not a non-empty string are skipped. Without ``--data``: prose from Python's own docstrings
  (:func:`~hf_mixedprec.core.demo.builtin_text`), split the same way as a ``.txt`` file.
- **Model and tokenizer** (``--model``; :func:`build_tokenizer`, :func:`build_model`): a local
  ``save_pretrained`` folder, loaded with ``local_files_only=True`` in float32 (the recipe's autocast gives
  the training precision); its tokenizer if the folder has one, else a byte-level BPE tokenizer trained on
  the data on the spot (then the model's ``vocab_size`` must hold it). Without ``--model``: a small Llama
  built from a config (:data:`~hf_mixedprec.core.demo.SMALL_LLAMA`) and a 2048-token tokenizer
  trained on the data. Nothing is ever downloaded.
- **Packing** (:func:`pack_blocks`): every example is tokenized without special tokens, followed by the
  tokenizer's EOS token (when it has one), concatenated, and cut into blocks of ``seq_len`` tokens; the
  remainder is dropped; ``labels = input_ids`` (the model shifts them).
- **Memory** (:func:`peak_memory`, :func:`free_memory`): what a run used, and what the device has free.

User mistakes raise :class:`hf_mixedprec.core.errors.UsageError` with one line naming the flag.
"""

from __future__ import annotations

import math
import os
import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_mixedprec.core._text import root_cause
from hf_mixedprec.core.demo import TRAINED_VOCAB, default_model_config
from hf_mixedprec.core.errors import UsageError
from hf_mixedprec.core.model_dir import read_model_config
from hf_mixedprec.integrations.recipe import Recipe

__all__ = [
    "DEFAULTS",
    "PackedBlocks",
    "Prepared",
    "RunSettings",
    "TextData",
    "build_model",
    "build_tokenizer",
    "check_data_path",
    "check_eval_split",
    "check_numbers",
    "check_output_dir",
    "free_memory",
    "load_texts",
    "pack_blocks",
    "peak_memory",
    "prepare_data",
    "sample_fp8_at_least_every",
]


#: Defaults of ``hf-mixedprec finetune`` (chosen so the built-in run finishes in about a minute on 2 CPU cores
#: with a clearly falling loss; see docs/quickstart.md for the measured numbers).
DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/finetune",
    "max_steps": 200,
    "seq_len": 128,
    "batch_size": 8,
    "lr": 1e-3,  # the model built from a config starts from random weights
    "lr_pretrained": 5e-5,  # with --model: fine-tuning pretrained weights
    "seed": 0,
    "text_field": "text",
    "eval_split": 0.05,  # with the built-in data
}


#: At most this many characters of the data are used to train a tokenizer (BPE training is then ~1 s).
TOKENIZER_TRAIN_CHARS = 4_000_000


TEXT_SUFFIXES = (".txt", ".text", ".md")


JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


DATA_ALLOWED = "a .txt, .jsonl, .json, .csv or .parquet file, or a datasets save_to_disk folder"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


BUILTIN_DATA = "built-in: prose from Python's standard-library docstrings"


@dataclass
class TextData:
    """The examples of a run, as non-empty strings."""

    texts: list[str]
    source: str  # the --data path, or BUILTIN_DATA
    kind: str  # builtin, txt, json, csv, parquet, save_to_disk
    rows: int  # rows read, before skipping empty / non-string ones

    @property
    def skipped(self) -> int:
        return self.rows - len(self.texts)


def _data_kind(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return "save_to_disk"
        raise UsageError(
            f"--data: {str(path)!r} is a folder but not one written by datasets' save_to_disk (no state.json or "
            f"dataset_dict.json) (allowed: {DATA_ALLOWED})"
        )
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "txt"
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix in (".csv", ".parquet"):
        return suffix[1:]
    raise UsageError(f"--data: {str(path)!r} has an unknown file type {suffix or '(none)'!r} (allowed: {DATA_ALLOWED})")


def check_data_path(data: str) -> str:
    """The kind of ``data`` (see :func:`load_texts`); a missing or unsupported path is a :class:`UsageError`."""
    path = Path(data)
    if not path.exists():
        raise UsageError(f"--data: {data!r} not found (allowed: {DATA_ALLOWED})")
    return _data_kind(path)


#: ``check_utf8`` reads the file in pieces of this many bytes (memory stays bounded whatever the file's size).
_UTF8_CHUNK = 1 << 20


NEWLINE = b"\n"


def check_utf8(data: str) -> None:
    """Refuse a text, JSON or CSV file that is not UTF-8, naming the line and byte of the first bad byte: datasets
    reads such a file without complaint and fails later, deep in pyarrow, when the text is taken out."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with open(data, "rb") as f:
        while chunk := f.read(_UTF8_CHUNK):
            held = decoder.getstate()[0]  # the start of a character the last chunk ended inside
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                seen = held + chunk  # what the decoder's positions count in
                bad = exc.start
                at_line = line + seen[:bad].count(NEWLINE)
                raise UsageError(
                    f"--data: {data!r} is not UTF-8 text: byte {offset - len(held) + bad:,} (line {at_line:,}) "
                    f"is {seen[bad]:#04x} (allowed: UTF-8 text; convert it first, e.g. iconv -f latin1 -t utf-8)"
                ) from None
            line += chunk.count(NEWLINE)
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UsageError(
            f"--data: {data!r} is not UTF-8 text: it ends inside a character (allowed: UTF-8 text)"
        ) from None


def _strings(values: Any) -> list[str]:
    return [v.strip() for v in values if isinstance(v, str) and v.strip()]


def load_texts(data: str | None = None, text_field: str | None = None) -> TextData:
    """The examples in ``data`` (see the module docs for the formats); ``None`` means the built-in text."""
    if data is None:
        from hf_mixedprec.core.demo import builtin_text

        parts = builtin_text().split("\n\n")
        return TextData(_strings(parts), BUILTIN_DATA, "builtin", len(parts))
    kind = check_data_path(data)
    field = text_field or DEFAULTS["text_field"]
    if kind == "txt" and text_field not in (None, "text"):
        raise UsageError(
            f"--text-field: {text_field!r} does not apply to a text file, where each paragraph is an example "
            "(allowed: leave it out, or use .jsonl/.json/.csv/.parquet data)"
        )
    if kind != "save_to_disk" and Path(data).stat().st_size == 0:
        raise UsageError(f"--data: {data!r} is empty: 0 usable examples (allowed: {DATA_ALLOWED} with text in it)")
    if kind in ("txt", "json", "csv"):
        check_utf8(data)
    import datasets

    datasets.disable_progress_bars()
    try:
        if kind == "txt":
            ds = datasets.Dataset.from_text(data, sample_by="paragraph")
        elif kind == "json":
            ds = datasets.Dataset.from_json(data)
        elif kind == "csv":
            ds = datasets.Dataset.from_csv(data)
        elif kind == "parquet":
            ds = datasets.Dataset.from_parquet(data)
        else:
            ds = datasets.load_from_disk(data)
    except Exception as exc:
        raise UsageError(f"--data: cannot read {data!r} as {kind} data ({root_cause(exc)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UsageError(
                f"--data: the DatasetDict in {data!r} has no 'train' split (allowed: a Dataset, or a DatasetDict "
                f"with a train split; it has: {', '.join(ds) or 'none'})"
            )
        ds = ds["train"]
    if not isinstance(ds, datasets.Dataset):
        raise UsageError(f"--data: {data!r} holds a {type(ds).__name__}, not a Dataset (allowed: {DATA_ALLOWED})")
    if ds.num_rows == 0:
        raise UsageError(f"--data: {data!r} has 0 rows: 0 usable examples")
    if field not in ds.column_names:
        raise UsageError(
            f"--text-field: {field!r} is not a column of {data!r} (allowed: {', '.join(ds.column_names) or 'none'})"
        )
    texts: list[str] = []
    try:
        for batch in ds.select_columns([field]).iter(batch_size=1000):
            texts += _strings(batch[field])
    except UnicodeDecodeError as exc:  # text pyarrow stored without checking (e.g. inside a parquet file)
        raise UsageError(f"--data: {data!r} holds text that is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not texts:
        raise UsageError(
            f"--data: {data!r} has 0 usable examples ({ds.num_rows} rows, none with a non-empty string in {field!r})"
        )
    return TextData(texts, data, kind, ds.num_rows)


def _vocab_size(config: Any) -> int | None:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    v = getattr(cfg, "vocab_size", None)
    return int(v) if v else None


def build_tokenizer(model_dir: str | None, data: TextData, model_config: Any = None) -> tuple[Any, str]:
    """The model folder's tokenizer if it has one, else a byte-level BPE tokenizer trained on ``data``."""
    if model_dir is not None and any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except Exception as exc:
            raise UsageError(f"--model: cannot load the tokenizer in {model_dir!r} ({root_cause(exc)})") from None
        how = f"the tokenizer in {model_dir} ({len(tok)} tokens)"
    else:
        from hf_mixedprec.core.demo import train_tokenizer

        vocab = TRAINED_VOCAB
        model_vocab = _vocab_size(model_config) if model_config is not None else None
        if model_vocab is not None:
            vocab = min(vocab, model_vocab)
        text, n = [], 0
        for t in data.texts:
            text.append(t)
            n += len(t) + 2
            if n >= TOKENIZER_TRAIN_CHARS:
                break
        tok = train_tokenizer("\n\n".join(text), vocab_size=vocab)
        how = f"byte-level BPE trained on the data ({len(tok)} tokens)"
    if model_config is not None:
        model_vocab = _vocab_size(model_config)
        if model_vocab is not None and len(tok) > model_vocab:
            raise UsageError(
                f"--model: {model_dir!r} has vocab_size {model_vocab}, fewer than the {len(tok)} tokens of "
                f"{how} (allowed: a model whose vocab_size holds its tokenizer; save the tokenizer in the folder)"
            )
    return tok, how


def build_model(
    model_dir: str | None, tokenizer: Any, *, seq_len: int, seed: int, dtype: Any = torch.float32
) -> tuple[Any, str]:
    """The model to train and a one-line description. ``dtype``: what ``--model`` is loaded in (``"auto"``: the dtype
    its ``config.json`` names, as transformers loads it; the recipe's ``storage:`` then decides what training keeps).
    The default model is built in float32."""
    if model_dir is None:
        from transformers import LlamaForCausalLM

        from hf_mixedprec.core.demo import SMALL_LLAMA

        torch.manual_seed(seed)
        model = LlamaForCausalLM(
            default_model_config(
                vocab_size=len(tokenizer),
                seq_len=seq_len,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        dims = ", ".join(f"{k.removesuffix('_size').replace('num_', '')} {v}" for k, v in SMALL_LLAMA.items())
        name = f"small Llama built from a config ({dims})"
    else:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        except Exception as exc:
            raise UsageError(f"--model: cannot load a causal LM from {model_dir!r} ({root_cause(exc)})") from None
        name = f"{model_dir} (loaded in {str(next(model.parameters()).dtype).removeprefix('torch.')})"
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 partitioned: full size
    return model, f"{name}, {n / 1e6:.2f}M parameters"


class PackedBlocks(torch.utils.data.Dataset):
    """Fixed-length token blocks for causal-LM training (``labels`` = ``input_ids``)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


#: An example longer than this many characters is tokenized in pieces of about this size, cut at whitespace, so the
#: tokenizer's memory is bounded by the piece, not by the example (tokens at a cut may differ from one pass).
MAX_PIECE_CHARS = 1 << 16


#: At most this many characters go to the tokenizer in one call.
_BATCH_CHARS = 1 << 22


def _pieces(text: str) -> Iterator[str]:
    start = 0
    while len(text) - start > MAX_PIECE_CHARS:
        end = start + MAX_PIECE_CHARS
        cut = max(
            text.rfind(" ", start + MAX_PIECE_CHARS // 2, end), text.rfind("\n", start + MAX_PIECE_CHARS // 2, end)
        )
        end = cut if cut > start else end
        yield text[start:end]
        start = end
    yield text[start:]


def _piece_batches(texts: list[str]) -> Iterator[list[tuple[str, bool]]]:
    """(piece, last piece of its example) in batches of at most 1000 pieces and :data:`_BATCH_CHARS` characters."""
    batch: list[tuple[str, bool]] = []
    size = 0
    for text in texts:
        parts = list(_pieces(text))
        for j, piece in enumerate(parts):
            if batch and (len(batch) >= 1000 or size + len(piece) > _BATCH_CHARS):
                yield batch
                batch, size = [], 0
            batch.append((piece, j == len(parts) - 1))
            size += len(piece)
    if batch:
        yield batch


def pack_blocks(
    texts: list[str], tokenizer: Any, seq_len: int, *, source: str = "the data"
) -> tuple[PackedBlocks, int]:
    """Tokenize, add EOS after each example, concatenate and cut into ``seq_len`` blocks; also the token count."""
    eos = tokenizer.eos_token_id
    chunks: list[np.ndarray] = []
    for batch in _piece_batches(texts):
        enc = tokenizer([piece for piece, _ in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for ids, (_, last) in zip(enc, batch, strict=True):
            chunks.append(np.asarray(ids, dtype=np.int64))
            if last and eos is not None:
                chunks.append(np.asarray([eos], dtype=np.int64))
    flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    n_blocks = flat.size // seq_len
    if n_blocks == 0:
        raise UsageError(
            f"--data: {source} gives {flat.size} tokens, fewer than one block of --seq-len {seq_len}: 0 usable "
            "blocks (allowed: more text, or a smaller --seq-len)"
        )
    blocks = torch.from_numpy(flat[: n_blocks * seq_len].copy()).view(n_blocks, seq_len)
    return PackedBlocks(blocks), int(flat.size)


def check_numbers(**values: Any) -> None:
    for flag, (value, low) in values.items():
        if value is None:
            continue
        if isinstance(low, float):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > low):
                raise UsageError(f"--{flag}: {value} is out of range (allowed: > {low:g})")
        elif value < low:
            raise UsageError(f"--{flag}: {value} is out of range (allowed: >= {low})")


def peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
    return rss_bytes / 2**20, "peak RSS of the process (resource.getrusage)"


def check_output_dir(output_dir: str) -> None:
    """``--output-dir`` must be a folder this process can create and write: checked before any work, without
    creating it (a probe file in its nearest existing folder), so that a mistake costs and leaves nothing."""
    from hf_mixedprec.training.run_control import check_not_dangling

    check_not_dangling("--output-dir", output_dir)
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir: {output_dir!r} is a file (allowed: a folder, new or existing)")
    base = next((p for p in (out, *out.absolute().parents) if p.exists()), None)
    try:
        if base is None or not base.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        probe = base / f".hf-mixedprec-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"--output-dir: {output_dir!r} cannot be written ({exc.strerror or exc}) (allowed: a folder you can write)"
        ) from None


def check_eval_split(eval_split: float | None) -> None:
    """``--eval-split``: a fraction of the blocks, below half (None: the command's default)."""
    if eval_split is not None and not (isinstance(eval_split, (int, float)) and 0 <= eval_split < 0.5):
        raise UsageError(f"--eval-split: {eval_split} is out of range (allowed: 0 <= F < 0.5)")


@dataclass
class Prepared:
    """The run's text, tokenizer and packed blocks."""

    texts: Any
    tokenizer: Any
    tokenizer_how: str
    train_ds: Any
    n_tokens: int
    eval_ds: Any = None


def prepare_data(
    data: str | None, text_field: str | None, model: str | None, seq_len: int, eval_split: float = 0.0
) -> Prepared:
    """Text, tokenizer and blocks: every remaining user mistake shows up here, before the model is built."""
    texts = load_texts(data, text_field)
    model_config = read_model_config(model) if model is not None else None
    if model_config is not None:
        max_pos = getattr(model_config, "max_position_embeddings", None)
        if max_pos and seq_len > max_pos:
            raise UsageError(
                f"--seq-len: {seq_len} is more than the max_position_embeddings {max_pos} of {model!r} "
                f"(allowed: <= {max_pos})"
            )
    tokenizer, tokenizer_how = build_tokenizer(model, texts, model_config)
    source = "the built-in text" if data is None else repr(data)
    train_ds, n_tokens = pack_blocks(texts.texts, tokenizer, seq_len, source=source)
    blocks = train_ds.blocks
    n_eval = max(1, round(eval_split * len(blocks))) if eval_split > 0 and len(blocks) >= 2 else 0
    if n_eval == 0:
        return Prepared(texts, tokenizer, tokenizer_how, train_ds, n_tokens)
    # the last blocks (the end of the text) are held out: a contiguous stretch the model never trains on
    return Prepared(
        texts, tokenizer, tokenizer_how, PackedBlocks(blocks[:-n_eval]), n_tokens, PackedBlocks(blocks[-n_eval:])
    )


def free_memory(device: torch.device) -> int | None:
    """Bytes free for a new allocation on ``device``: the CUDA driver's free memory, or the kernel's MemAvailable
    (Linux) on a CPU; None where neither can be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def sample_fp8_at_least_every(recipe: Recipe, every: int) -> Recipe:
    """``recipe`` with FP8 statistics sampled at least every ``every`` steps, so that a short run sees them (the
    recipe's interval is meant for long runs; it is never raised, only lowered); ``recipe`` itself when it already
    samples that often or is not FP8. The caller says so when it changed."""
    cur = recipe.health.fp8_sample_every
    if "fp8" not in recipe.precisions() or not cur or cur <= every:
        return recipe
    return recipe.model_copy(update={"health": recipe.health.model_copy(update={"fp8_sample_every": every})})


@dataclass(frozen=True)
class RunSettings:
    """The numbers of one run (after the defaults are applied): where it writes, what it trains and how often it logs
    and saves."""

    out: Path
    model: str | None
    max_steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    logging_steps: int
    save_steps: int
    save_total_limit: int | None
    #: a resume under a recipe of other numerics than the checkpoint's goes on (``finetune --allow-recipe-change``)
    allow_recipe_change: bool = False
