"""Results layer: store (evaluation identities), typed metric fields, aggregation/statistics,
scaling fit, report and supplement with their figures (one plotting set-up: ``plotting``).

Data flow: evaluation code writes :class:`EvalRecord` rows into a :class:`ResultsStore`; the report
reads the store file (never live models). Nothing here imports torch or the model code.

Heavy pieces are imported lazily: ``from looplm.results import ResultsStore`` is cheap.
"""

from __future__ import annotations

from looplm.results.export import load_records
from looplm.results.store import IDENTITY_FIELDS, EvalRecord, ResultsStore
from looplm.settings.plugins import lazy_attributes

__all__ = [
    "IDENTITY_FIELDS",
    "EvalRecord",
    "ResultsStore",
    "load_records",
    "NLLAccumulator",
    "summarize",
    "paired_deltas",
    "write_report",
    "write_supplement",
]

__getattr__ = lazy_attributes(
    __name__,
    {
        "NLLAccumulator": "looplm.results.stats",
        "summarize": "looplm.results.stats",
        "paired_deltas": "looplm.results.stats",
        "write_report": "looplm.results.report",
        "write_supplement": "looplm.results.supplement",
    },
)
