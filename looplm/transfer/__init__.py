"""Held-out transfer: a trained run's fixed-depth sweep on other corpora, with no training on them,
as one analysis in one package: the sweep kind (:mod:`~looplm.transfer.kind`,
``evaluate.transfer``) on the fixed-depth sweep of :mod:`looplm.evaluate`; its rows are reported by
the depth tables of :mod:`looplm.results.report`."""
