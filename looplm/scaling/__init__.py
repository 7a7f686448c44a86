"""The recurrence scaling law of the recurrence-equivalence study, as one analysis in one package:
its fit (:mod:`~looplm.scaling.fit`), the sweep kind that writes its points
(:mod:`~looplm.scaling.kind`, ``evaluate.scaling``) and its report section
(:mod:`~looplm.scaling.section`)."""
