"""Small models and text that exist on any machine: no hub downloads, nothing from outside the install.

``tiny_llama`` builds a ``LlamaForCausalLM`` from a config; ``builtin_text`` gathers English prose from the
docstrings of Python's own standard library (present on every Python install); ``byte_batches`` turns text
into fixed-length token batches with a byte-level vocabulary (256 ids), so no tokenizer is needed.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

__all__ = [
    "SMALL_LLAMA",
    "TINY_LLAMA",
    "TRAINED_VOCAB",
    "builtin_text",
    "byte_batches",
    "default_model_config",
    "small_llama",
    "tiny_llama",
    "tiny_llama_config",
    "train_tokenizer",
]

_STDLIB_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "io",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "zipfile",
)


#: The test suite's Llama (byte vocabulary); every Linear dim a multiple of 32 (FP8 and MXFP8 friendly).
TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` with the :data:`TINY_LLAMA` dims and eager attention (``overrides`` win)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, "attn_implementation": "eager", **overrides})


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` (float32) built from :func:`tiny_llama_config`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


#: The ``finetune`` default: a Llama a bit larger than the test one (about 2.3M parameters besides the
#: embeddings); every Linear dim a multiple of 32, so FP8 and MXFP8 layouts apply to all of them.
SMALL_LLAMA: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


#: Vocabulary of a tokenizer ``finetune`` trains on the spot (capped by the model's vocab_size with --model).
TRAINED_VOCAB = 2048


def default_model_config(*, vocab_size: int = TRAINED_VOCAB, seq_len: int = 512, **token_ids: Any) -> Any:
    """The config of the model ``finetune`` builds without ``--model`` (and ``estimate`` sizes without one):
    :data:`SMALL_LLAMA` dims, the tokenizer's vocabulary, positions for ``seq_len``."""
    return tiny_llama_config(
        **SMALL_LLAMA, vocab_size=vocab_size, max_position_embeddings=max(512, seq_len), **token_ids
    )


def small_llama(seed: int = 0, **overrides: Any) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` with the :data:`SMALL_LLAMA` dims (``overrides`` win)."""
    return tiny_llama(seed=seed, **{**SMALL_LLAMA, **overrides})


def builtin_text(min_chars: int = 200_000) -> str:
    """English prose from the standard library's docstrings, in a fixed order (deterministic per Python)."""
    parts: list[str] = []
    total = 0
    for name in _STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover - a trimmed Python
            continue
        objs = [mod] + [obj for _, obj in sorted(vars(mod).items()) if inspect.isclass(obj) or inspect.isfunction(obj)]
        for obj in objs:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(doc)
                total += len(doc)
        if total >= min_chars:
            break
    return "\n\n".join(parts)


def byte_batches(text: str, *, seq_len: int, batch_size: int, n_batches: int, seed: int = 0) -> list[torch.Tensor]:
    """``n_batches`` LongTensors ``[batch_size, seq_len]`` of UTF-8 bytes cut at random offsets of ``text``."""
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    if data.numel() <= seq_len:
        raise ValueError(f"text has {data.numel()} bytes, fewer than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=g)
        out.append(torch.stack([data[s : s + seq_len] for s in starts.tolist()]))
    return out


def train_tokenizer(text: str, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` on the spot (``tokenizers``), as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|bos|>", "<|eos|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>")
