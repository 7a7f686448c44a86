"""The target of a position that is not scored.

Batches pair input ids with targets of the same shape; a position whose target is
``IGNORE_INDEX`` (PyTorch's cross-entropy default, -100) is neither trained on nor scored —
padding, prompts and, in synthetic tasks, everything but the answer positions. Data, model and
evaluation all read this one constant.
"""

from __future__ import annotations

IGNORE_INDEX = -100
