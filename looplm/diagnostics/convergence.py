"""Per-token convergence of the recurrent state (the per-token convergence study: "what a
depth-recurrent Transformer computes per token").

* successive-output KL per loop: ``KL_t = KL(p_t ‖ p_{t−1})`` with ``p_t = softmax(readout(h_t))``,
  t = 1 … T (``p_0`` reads out the initial state), averaged over tokens;
* per-token state change ``‖h_t − h_{t−1}‖₂ / ‖h_{t−1}‖₂``;
* per-token convergence depth: the first loop t whose ``KL_t`` falls below a threshold τ — the loop
  at which the training-free KL halting rule would stop that token (T + 1 when it never does);
* its distribution by token type: whitespace, punctuation, function words, content words (and
  ``other`` for numbers, end-of-text and undecodable pieces). Byte-level tokens take the type of
  the word they belong to.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence

import torch

from looplm.diagnostics.settings import DEFAULT_KL_THRESHOLD
from looplm.model.readout import successive_kl_rows

TOKEN_TYPES = ("whitespace", "punctuation", "function", "content", "other")

# Closed-class English words (articles, pronouns, prepositions, conjunctions, auxiliaries,
# determiners, common particles).
FUNCTION_WORDS = frozenset(
    """a an the this that these those some any each every either neither no all both half
    i me my mine myself you your yours yourself yourselves he him his himself she her hers herself
    it its itself we us our ours ourselves they them their theirs themselves who whom whose which
    what whatever whoever one ones
    of in on at by for with about against between into through during before after above below
    to from up down out off over under again further than upon within without along across
    behind beyond among around toward towards onto via per since until till despite unlike
    and or but nor so yet if because although though while whereas unless whether as
    be am is are was were been being have has had having do does did doing done
    will would shall should can could may might must ought
    not n't 't 's 're 've 'd 'll 'm
    don't doesn't didn't isn't aren't wasn't weren't can't cannot won't wouldn't shouldn't
    couldn't hasn't haven't hadn't it's that's there's here's what's who's let's
    i'm i've i'd i'll you're you've you'd you'll we're we've we'd we'll they're they've they'd
    they'll he's he'd he'll she's she'd she'll
    there here then when where why how also just only very too more most such own same other
    another few many much several""".split()
)
_CLITICS = frozenset(["'s", "'t", "'re", "'ve", "'d", "'ll", "'m"])
_PUNCT = frozenset(string.punctuation) | frozenset("“”‘’—–…«»·•")
_WHITESPACE_BYTES = frozenset(b" \t\n\r\x0b\x0c")


@torch.no_grad()
def successive_kl(
    readout: Callable[[torch.Tensor], torch.Tensor],
    states: Sequence[torch.Tensor],
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``KL(p_t ‖ p_{t−1})`` per token for t = 1 … T: (T, B, L) float64 (exactly 0 where
    ``h_t == h_{t−1}``). The readout goes through the tokens in chunks
    (:func:`looplm.model.readout.successive_kl_rows`; ``vocab_size`` sizes them, default: one
    readout of the first token)."""
    B, L, d = states[0].shape
    if vocab_size is None:
        vocab_size = readout(states[0][:1, :1]).shape[-1]
    rows = [h.reshape(B * L, d) for h in states]
    kl = successive_kl_rows(readout, rows, vocab_size, dtype=torch.float64)  # (T, B·L)
    return kl.clamp_min(0.0).view(len(states) - 1, B, L)


def relative_state_change(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """``‖h_t − h_{t−1}‖₂ / ‖h_{t−1}‖₂`` per token: (T, B, L) float64."""
    out = []
    for a, b in zip(states[:-1], states[1:]):
        den = a.double().norm(dim=-1)
        out.append((b - a).double().norm(dim=-1) / den.clamp_min(torch.finfo(torch.float64).tiny))
    return torch.stack(out)


def convergence_depth(kl: torch.Tensor, threshold: float = DEFAULT_KL_THRESHOLD) -> torch.Tensor:
    """First loop t (1-based) with ``KL_t < threshold`` per token; T + 1 if none: (B, L) int64."""
    T = kl.shape[0]
    below = kl < threshold  # (T, B, L)
    first = below.double().argmax(dim=0) + 1  # argmax finds the first True
    return torch.where(below.any(dim=0), first, torch.full_like(first, T + 1)).long()


def _word_type(word: str) -> str:
    w = word.lower().replace("’", "'")
    if w in FUNCTION_WORDS:
        return "function"
    if w.endswith("'s") and len(w) > 2:  # possessive: the type of the noun
        return _word_type(w[:-2])
    if any(c.isalpha() for c in w):
        return "content"
    return "other"


def _byte_types(row: Sequence[int], eot_id: int) -> list[str]:
    """Types of byte-level tokens: letters (and UTF-8 multibyte bytes, apostrophes inside a word)
    form words, and every byte of a word takes the word's type."""
    types = ["other"] * len(row)
    i = 0
    n = len(row)
    while i < n:
        b = int(row[i])
        if b == eot_id or b > 255:
            i += 1
            continue
        if b in _WHITESPACE_BYTES:
            types[i] = "whitespace"
            i += 1
            continue
        if (65 <= b <= 90) or (97 <= b <= 122) or b >= 128:
            j = i
            while j < n:
                c = int(row[j])
                word_byte = (65 <= c <= 90) or (97 <= c <= 122) or 128 <= c <= 255
                inner_apostrophe = (
                    c == 39
                    and j + 1 < n
                    and 65 <= int(row[j + 1]) <= 122
                    and chr(int(row[j + 1])).isalpha()
                )
                if not (word_byte or inner_apostrophe):
                    break
                j += 1
            word = bytes(int(c) for c in row[i:j]).decode("utf-8", errors="replace")
            kind = _word_type(word)
            for k in range(i, j):
                types[k] = kind
            i = j
            continue
        ch = chr(b)
        types[i] = "punctuation" if ch in _PUNCT else "other"
        i += 1
    return types


def _piece_types(pieces: Sequence[str]) -> list[str]:
    """Types of sub-word pieces (e.g. GPT-2 BPE): a piece that starts with a letter (or is a clitic
    such as 's or 't) right after a piece that ends with a letter continues that word; all pieces of
    a word share its type."""
    types = ["other"] * len(pieces)
    words: list[list[int]] = []
    for i, p in enumerate(pieces):
        if p == "" or p.isspace():
            types[i] = "whitespace"
            continue
        s = p.strip()
        if all(c in _PUNCT for c in s):
            types[i] = "punctuation"
            continue
        clitic = p.replace("’", "'").lower() in _CLITICS  # GPT-2 splits "didn't" → didn + 't
        cont = (
            words
            and words[-1][-1] == i - 1
            and (p[:1].isalpha() or clitic)
            and pieces[i - 1][-1:].isalpha()
        )
        if cont:
            words[-1].append(i)
        else:
            words.append([i])
    for w in words:
        text = "".join(pieces[k] for k in w).strip()
        if text.lower().replace("’", "'") not in FUNCTION_WORDS:  # keep 's, n't as they are
            text = text.strip(string.punctuation)
        kind = _word_type(text) if text else "punctuation"
        for k in w:
            types[k] = kind
    return types


def token_types(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Token-type codes (indices into :data:`TOKEN_TYPES`) for ids (B, L) → (B, L) int64.

    ``tokenizer`` is a looplm tokenizer (``name``, ``eot_id``, ``decode``); byte-level tokenizers
    are typed by the word each byte belongs to, others by decoding each token to its text piece.
    """
    code = {name: i for i, name in enumerate(TOKEN_TYPES)}
    rows = []
    for row in ids.tolist():
        if getattr(tokenizer, "name", "") == "bytes":
            kinds = _byte_types(row, tokenizer.eot_id)
        else:
            pieces = ["" if i == tokenizer.eot_id else tokenizer.decode([i]) for i in row]
            kinds = _piece_types(pieces)
            kinds = ["other" if i == tokenizer.eot_id else k for i, k in zip(row, kinds)]
        rows.append([code[k] for k in kinds])
    return torch.tensor(rows, dtype=torch.long)


def depth_by_type(
    depth: torch.Tensor, types: torch.Tensor, loops: int, valid: torch.Tensor | None = None
) -> dict[str, dict]:
    """Convergence-depth distribution per token type: count, mean, median, fraction not converged
    by T, histogram over 1 … T+1 (T+1 = never below τ). ``valid`` (B, L) restricts the tokens."""
    if valid is None:
        valid = torch.ones_like(depth, dtype=torch.bool)
    out = {}
    for i, name in enumerate(TOKEN_TYPES):
        d = depth[(types == i) & valid].double()
        if d.numel() == 0:
            out[name] = {"count": 0}
            continue
        hist = torch.bincount(d.long(), minlength=loops + 2)[1:].tolist()  # depths 1 … T+1
        out[name] = {
            "count": int(d.numel()),
            "mean": float(d.mean()),
            "median": float(d.median()),
            "not_converged_frac": float((d > loops).double().mean()),
            "hist": hist,
        }
    return out
