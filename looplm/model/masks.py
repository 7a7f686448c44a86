"""The data-given attention mask of ``model.attention=adjacency``.

Graph rows (the ``graph_nodes`` task) are written ``uv;uv;…|<nodes>``: directed edges as letter
pairs, ``|``, then one letter per node. The mask lets a node's position attend to itself and to
its in-neighbours' positions only, so one attention layer moves information one hop along the
edges; the model reads it from the token ids (:meth:`looplm.model.lm.LanguageModelBase.attention_mask`).
"""

from __future__ import annotations

import torch

GRAPH_SEP = ord("|")  # between the edge list and the node letters


def adjacency_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of ``model.attention=adjacency``: (B, L) ids → (B, L, L) bool.

    For a row of the ``graph_nodes`` task (:func:`looplm.data.synthetic.graph_nodes_example`), the position of node v may attend to itself and to the
    positions of its in-neighbours u (edges ``u v``), so one attention layer moves information
    exactly one hop along the edges. Every other position (the edge list, ``|``, padding, rows
    without ``|``) attends only to itself.
    """
    B, L = input_ids.shape
    mask = torch.eye(L, dtype=torch.bool, device=input_ids.device).repeat(B, 1, 1)
    rows = input_ids.tolist()
    bi, qi, ki = [], [], []
    for b, ids in enumerate(rows):
        if GRAPH_SEP not in ids:
            continue
        sep = ids.index(GRAPH_SEP)
        pos = {}
        for j in range(sep + 1, L):
            c = ids[j]
            if not (65 <= c <= 90 or 97 <= c <= 122):
                break
            pos[c | 0x20] = j  # lower-cased letter → its node position
        for i in range(0, sep - 1, 3):  # "uv;" triples
            u, v = ids[i] | 0x20, ids[i + 1] | 0x20
            if u in pos and v in pos:
                bi.append(b)
                qi.append(pos[v])
                ki.append(pos[u])
    if bi:
        mask[bi, qi, ki] = True
    return mask
