"""Experiments as code: grids of methods × seeds × evaluations (:mod:`looplm.experiments.grid`,
run by :mod:`looplm.experiments.runner`, shared between processes by
:mod:`looplm.experiments.cells`), the paper's tables and verdicts (:mod:`looplm.experiments.paper`),
findings computed from committed rows (:mod:`looplm.experiments.findings`) and the embedded demo
(:mod:`looplm.experiments.demo`)."""
