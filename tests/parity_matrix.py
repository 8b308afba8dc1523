"""The entry-point parity matrix: every way of using hf_mixedprec (rows) against every promise it makes (columns).

Each cell is ``yes`` (a test in tests/integrations/test_parity.py runs that entry point and asserts the promise on values),
``refused`` (the combination is refused with one line, and that refusal is the cell's test) or ``n/a`` (the entry
point has nothing the promise could apply to; the reason is in the table). ``scripts/gen_parity_table.py`` writes
docs/parity.md from this file, and a test keeps the two equal, so the docs never claim a cell no test runs.
"""

from __future__ import annotations

#: Entry points, in table order: key -> what the user writes.
ENTRIES: dict[str, str] = {
    "trainer": "`Trainer(callbacks=recipe.callbacks())`",
    "late": "`trainer.add_callback(cb)` after the Trainer was built",
    "plugin": "own Accelerate loop: `recipe.accelerator()`",
    "finetune": "`hf-mixedprec finetune`",
    "compare": "`hf-mixedprec compare`",
}

#: Promises, in table order: key -> (column title, what the cell's test asserts).
PROMISES: dict[str, tuple[str, str]] = {
    "skips": (
        "skips exactly",
        "an inf gradient at step 3 is skipped: counted once in `mp/skipped_steps`, and the weights of that step "
        "are those of the step before",
    ),
    "resume": (
        "exact resume",
        "a run resumed from its step-4 checkpoint ends with the weights, moved layers and events of the run that "
        "was never interrupted, bit for bit",
    ),
    "report": (
        "health report",
        "the run's report holds the loss series, the FP8 saturation event and the fallback",
    ),
    "phases": ("phases", "the BF16 warm-up ends after step 2: FP8 from step 3, `mp/phase` per step"),
    "fallbacks": (
        "fallbacks",
        "an input outlier from step 5 saturates the FP8 layers it reaches; the fallback moves exactly the layers "
        "whose saturation fired to BF16, and the run trains on with them there",
    ),
    "storage": (
        "storage precision",
        "`storage: {optimizer_states: bf16}`: the optimizer that trains keeps its moments in BF16",
    ),
    "fp8_health": (
        "FP8 health",
        "per-layer FP8 saturation is reported: above the threshold for the outlier's layers, and for no layer the "
        "fallback left in FP8",
    ),
    "log_row": (
        "one log row",
        "the step's `mp/` metrics sit in the step's own row beside its loss; no row holds `mp/` metrics alone",
    ),
    "recipe_change": (
        "resume under another recipe",
        "the step-4 checkpoint resumed under the same recipe without its phases (bf16->fp8 becomes fp8, not a step "
        "down in precision) is refused in one line naming both recipes and the flag that allows it; no step trains",
    ),
    "refusal": (
        "refuses what it cannot run",
        "a `distributed.strategy: deepspeed` recipe where no DeepSpeed runs is refused in one line",
    ),
}

YES, REFUSED, NA = "yes", "refused", "n/a"

#: (entry, promise) -> (status, how the cell holds or why not). Every pair is present.
CELLS: dict[tuple[str, str], tuple[str, str]] = {
    **{("trainer", p): (YES, "") for p in PROMISES},
    **{("late", p): (YES, "") for p in PROMISES if p != "storage"},
    ("late", "storage"): (
        REFUSED,
        "a non-default `storage:` needs its optimizer built before Trainer builds its own: refused with "
        "`StorageRefusal`, which names `attach(trainer, recipe)` / `Trainer(callbacks=...)`",
    ),
    **{("plugin", p): (YES, "") for p in PROMISES},
    **{("finetune", p): (YES, "") for p in PROMISES},
    **{("compare", p): (YES, "") for p in PROMISES if p not in ("resume", "log_row", "recipe_change")},
    ("compare", "recipe_change"): (
        NA,
        "compare keeps no checkpoints, so nothing is resumed under another recipe (`--resume` is refused by its "
        "parser)",
    ),
    ("compare", "resume"): (
        REFUSED,
        "compare trains short runs from the same start and keeps no checkpoints: `--resume` is refused by its "
        "parser (exit 2)",
    ),
    ("compare", "log_row"): (
        NA,
        "compare prints no per-step rows; each run's rows are the Trainer's (see the Trainer row)",
    ),
}

CELLS[("plugin", "log_row")] = (
    YES,
    "`accelerator.mp_metrics(loss=...)` returns the step's row (its own phase and loss scale, not the next "
    "step's) and keeps it in `accelerator.mp_log`, beside the loop's own values",
)
CELLS[("plugin", "report")] = (
    YES,
    "`write_run_report(dir, log_history=accelerator.mp_log, runtime=accelerator.mp)` (from `hf_mixedprec.training.run_report`) "
    "writes `health.json` and the plots",
)
CELLS[("compare", "report")] = (YES, "`compare.json` holds each run's events and notes")
