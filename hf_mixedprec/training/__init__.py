"""Around each optimizer step, trainer-free: loss scaling (``amp``), clipping (``clipping``, ``clipping_base``), the
health monitor (``health``) and what its events do (``reactions``), precision phases (``phases``), the runtime that
sequences a step (``runtime``, ``runtime_stats``), run control (output folder, checkpoints, Ctrl-C: ``run_control``)
and the run report (``run_report``).

May import: ``core``, ``scaling``, ``recipes``, ``fp8``, ``storage``, ``precision``.
"""
