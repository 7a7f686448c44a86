"""Findings of the experiment grids as data: each grid's claims (of the source papers it tests)
are stated in its config, and their verdicts are computed from the grid's committed rows.

An experiment config (``configs/experiments/*.yaml``) may carry a ``findings:`` section, which
the sweep ignores::

    findings:
      source: "*Thinking Deeper, Not Longer* (abstract)"
      claims:
        - text: depth recurrence extrapolates beyond the training range, above fixed depth
          test: ordering          # threshold | ordering | climb | phi_value | phi_order | untestable
          metric: accuracy        # accuracy | min_accuracy | stability (frontier rows, percent)
          method: gated           # or methods: [...] (every one must pass)
          than: [unshared_6l]     # ordering: the rivals, paired by seed
          difficulties: [5, 12]   # the difficulties pooled
          depth: max              # the T read (an int, or max: each method's deepest T)

and ``looplm findings`` (:func:`grid_findings`) turns the grid's rows — its results store, or the
export committed under ``docs/data/`` with ``--data`` — into one verdict word per claim, from the
vocabulary of :mod:`looplm.results.vocabulary`, each with its criterion and evidence. The pages
quote the generated table between ``<!-- generated: findings GRID -->`` and
``<!-- end generated -->`` (``looplm findings --write PAGE`` refreshes them; a test fails when a
block is stale). Prose may explain a verdict, never upgrade it.
"""

from looplm.settings.plugins import lazy_attributes

# a light face (the command line imports this package at start-up): names load on first use
__getattr__ = lazy_attributes(
    __name__,
    {
        "CLAIM_KEYS": "looplm.experiments.findings.claims",
        "TESTS": "looplm.experiments.findings.claims",
        "GridFindings": "looplm.experiments.findings.claims",
        "check_claims": "looplm.experiments.findings.claims",
        "claim_verdict": "looplm.experiments.findings.claims",
        "findings_grids": "looplm.experiments.findings.claims",
        "grid_findings": "looplm.experiments.findings.claims",
        "refresh_blocks": "looplm.experiments.findings.claims",
    },
)

__all__ = [
    "CLAIM_KEYS",
    "TESTS",
    "GridFindings",
    "check_claims",
    "claim_verdict",
    "findings_grids",
    "grid_findings",
    "refresh_blocks",
]
