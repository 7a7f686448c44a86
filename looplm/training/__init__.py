"""Training: the loop (:mod:`looplm.training.loop`, ``fit``), the one user of
``torch.distributed`` (:mod:`looplm.training.distributed`) and the run folder's rules
(:mod:`looplm.training.run_folder`)."""
