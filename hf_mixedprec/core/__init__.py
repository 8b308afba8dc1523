"""Foundations: what every layer may use and which imports nothing else of the package.

Errors (every user-mistake exception), metric names, number-format facts, the embedded demo model and text, model
folders, checkpoint manifests, and the small private helpers (``_device``, ``_text``, ``_optional``, ``_stdio``,
``_launcher``) and ``_private``, the fence around every private name of torch, Accelerate and transformers. Moved
module names of earlier releases answer through ``_moved``.

May import: nothing of hf_mixedprec outside ``core``.
"""
