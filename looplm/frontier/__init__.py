"""The computational frontier on synthetic tasks (*Thinking Deeper, Not Longer*), as one analysis
in one package: accuracy over thinking steps × difficulty and the graph task's propagation steps
(:mod:`~looplm.frontier.measure`), the sweep kinds that write them (:mod:`~looplm.frontier.kind`,
``evaluate.frontier`` and ``evaluate.propagation``) and their report section, tables and figures
(:mod:`~looplm.frontier.section`)."""
