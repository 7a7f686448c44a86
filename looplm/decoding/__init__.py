"""Decoding: the cached, adaptive-depth decoder (:mod:`looplm.decoding.decoder`), what ``looplm
generate`` runs (:mod:`looplm.decoding.generate`), continuous batching
(:mod:`looplm.decoding.batching`), the OpenAI-compatible server (:mod:`looplm.decoding.serve`),
Hugging Face export (:mod:`looplm.decoding.hf`) and the lm-evaluation-harness adapter
(:mod:`looplm.decoding.lmeval`)."""
