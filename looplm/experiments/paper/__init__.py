"""The SCSE paper as code: a catalogue of its tables and figures, each an experiment grid under
``configs/paper/`` (``table01.yaml`` … ``table22.yaml``, ``figure3.yaml`` … ``figure5.yaml``,
``convergence.yaml``), with what each needs and costs, where it stands, and its paper-vs-measured
report.

Every entry's YAML is an ordinary experiment config (:mod:`looplm.experiments.runner`) plus a ``paper:``
section::

    paper:
      id: table02                  # the file's stem
      title: Anchor design ablation
      protocol: WikiText-103, 22M, 5k steps, 3 seeds     # the paper's setting, in words
      reuses: wikitext_22m.yaml    # the shared grid(s) whose runs it reads (trains nothing new)
      needs: [wikitext-103]        # corpora of the paper's protocol (--full)
      gpu_only: false              # true: the measurement itself needs an accelerator
      experiment: true             # false: nothing to run (the notation table)
      claim: The learned anchor has the lowest PPL at every depth.
      reported:                    # the values the paper's text gives
        - {method: scse, depth: 8, metric: ppl, value: 155.1, std: 0.6}

``reported`` rows name a ``metric`` (:data:`METRICS`) and what selects it: ``method``,
``depth``, ``reference`` (paired deltas), ``budget`` (adaptive depth), ``dataset`` (transfer),
``step`` (diagnostics, 0-based t), ``scale`` (a tier: 22m / 50m / 95.6m / ctx512 / ctx1024,
mapped to the grid's training variant by :data:`TIERS`). Measured values come from the entry's
results store: the CPU analogue's by default, the full protocol's with ``full=True``.

Costs use Eqs. 20–21 (:mod:`looplm.model.accounting`): training 3 × FLOPs_body+head at the mean sampled
depth per token, evaluation FLOPs_body+head(T) per scored token at each depth, and a rate: on the
CPU the rate the paper grids' runs log (their ``metrics.jsonl``), else :data:`CPU_FLOPS`; on one
H200 its dense bf16 peak at an assumed model-FLOPs utilisation (:data:`H200_MFU`; no H200
measurement exists yet).
"""

from looplm.experiments.paper.costs import (
    Cost,
    catalogue_rows,
    corpus_present,
    format_catalogue,
    grid_cost,
    grid_status,
    measured_cpu_rate,
    run_flops,
)
from looplm.experiments.paper.entries import (
    CONFIG_DIR,
    CPU_FLOPS,
    ENTRY_IDS,
    H200_MFU,
    H200_PEAK,
    METRICS,
    TIERS,
    Entry,
    catalogue,
    find_entry,
    load_entry,
)
from looplm.experiments.paper.report import (
    _fmt,
    diagnostics_figures,
    entry_report,
    measure,
    paper_report,
)

__all__ = [
    "CONFIG_DIR",
    "CPU_FLOPS",
    "ENTRY_IDS",
    "H200_MFU",
    "H200_PEAK",
    "METRICS",
    "TIERS",
    "Cost",
    "Entry",
    "_fmt",
    "catalogue",
    "catalogue_rows",
    "corpus_present",
    "diagnostics_figures",
    "entry_report",
    "find_entry",
    "format_catalogue",
    "grid_cost",
    "grid_status",
    "load_entry",
    "measure",
    "measured_cpu_rate",
    "paper_report",
    "run_flops",
]
