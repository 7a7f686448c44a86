"""Adaptive loop depth under a ceiling, as one analysis in one package.

* :mod:`~looplm.adaptive.settings` — its settings (the command line is made from them);
* :mod:`~looplm.adaptive.depth` — the per-example max-token rule, calibration, timing and the
  driver :func:`~looplm.adaptive.depth.evaluate_adaptive`; :mod:`~looplm.adaptive.halting` —
  per-token KL halting and the linear router;
* :mod:`~looplm.adaptive.kind` — the ``adaptive`` sweep kind; :mod:`~looplm.adaptive.section` —
  its report section; :mod:`~looplm.adaptive.command` — ``looplm adaptive``.

The package's face is light (no torch): the command line is built from its settings at start-up.
"""
