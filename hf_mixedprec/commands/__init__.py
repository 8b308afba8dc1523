"""The applications behind ``hf-mixedprec finetune`` (``finetune``, ``finetune_summary``), ``compare``
(``compare``, ``compare_measure``, ``compare_report``), ``estimate`` (``estimate``, ``estimate_step``) and ``simulate``,
and what ``finetune`` and ``compare`` share (``workload``: data, tokenizer, model, packed blocks, memory).

May import: every folder below it (``core`` up to ``integrations``); never ``cli``.
"""
