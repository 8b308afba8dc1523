"""The precision plan: per module what it computes in (FP8 or why not, the rule that decided) and per parameter what
it is loaded, kept and mastered in (``plan``), and the precision map printed from it (``plan_map``). Built once from
(recipe, model); storage setup, FP8 conversion, phases, ``estimate``, ``simulate`` and the run report read it.

May import: ``core``, ``scaling``, ``recipes``, ``fp8``, ``storage``.
"""
