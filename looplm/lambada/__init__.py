"""LAMBADA last-word completion at several loop depths (the paper's out-of-domain completion), as
one analysis in one package: the measurement (:mod:`~looplm.lambada.completion`) and the sweep
kind that writes its rows (:mod:`~looplm.lambada.kind`, ``evaluate.lambada``); its rows are
reported by the depth tables of :mod:`looplm.results.report`."""
