"""The Jacobian lens, as one analysis in one package.

* :mod:`~looplm.lens.settings` — its settings (the command line is made from them);
* :mod:`~looplm.lens.jacobian` — J_t per loop step (exact and Hutchinson fits, merge, files,
  logit lens); :mod:`~looplm.lens.readout` — tuned lens, fidelity, token ranks;
* :mod:`~looplm.lens.structure` — ranks, subspace overlaps, stationarity, composition,
  persistence; :mod:`~looplm.lens.interventions` — steer, coordinate swap, project-out,
  dose-response;
* :mod:`~looplm.lens.analysis` — the whole analysis of ``looplm lens``; :mod:`~looplm.lens.plots`
  its figures; :mod:`~looplm.lens.command` — the command;
* :mod:`~looplm.lens.twohop` and :mod:`~looplm.lens.kind` — the lens on the two-hop task as a
  sweep's evaluation kind (``evaluate.lens``); :mod:`~looplm.lens.section` — its report section.

The package's face is light (no torch): the command line is built from its settings at start-up.
"""
