"""`looplm data prepare NAME ...` and `looplm data info DIR`: build and inspect token caches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from looplm.data.settings import InfoSettings, PrepareSettings
from looplm.errors import LoopLMError
from looplm.settings.options import add_options, from_args

SETTINGS = {"data prepare": (PrepareSettings,), "data info": (InfoSettings,)}


def register(subparsers) -> None:
    """Add the ``data`` command with its ``prepare`` and ``info`` actions."""
    from looplm.data.corpora import CORPORA

    p = subparsers.add_parser(
        "data",
        help="tokenize corpora into reusable token caches",
        description="Tokenize a corpus once into memory-mapped token caches; inspect caches.",
    )
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    pp = sub.add_parser(
        "prepare",
        help="tokenize a corpus (all splits by default) into a token cache",
        description=(
            f"NAME is one of {', '.join(CORPORA)}, text:PATH, or a path to a .txt/.jsonl/"
            ".json(.gz) file or a folder of them. Without --source/--data-dir the corpus is "
            "read online through HuggingFace datasets (optional extra)."
        ),
    )
    pp.add_argument("name", metavar="NAME")
    add_options(pp, PrepareSettings)
    pp.set_defaults(func=_prepare)

    pi = sub.add_parser("info", help="print the metadata of the token caches in a folder")
    pi.add_argument("dir", metavar="DIR")
    add_options(pi, InfoSettings)
    pi.set_defaults(func=_info)


def _prepare(args: argparse.Namespace) -> int:
    from looplm.data.cache import default_cache_dir, prepare, shared_source
    from looplm.data.corpora import (
        SPLITS,
        available_splits,
        canonical_split,
        check_corpus_name,
    )

    check_corpus_name(args.name)
    s = from_args(PrepareSettings, args)  # --source with --data-dir: one line naming both
    out = Path(s.out).expanduser() if s.out else default_cache_dir()
    from looplm.settings.limits import check_output_folder

    check_output_folder("--out", out)  # before tokenizing
    if s.split:
        splits = list(dict.fromkeys(canonical_split(x) for x in s.split))
    elif s.data_dir:  # the splits whose files the data folder has
        splits = [
            x
            for x in SPLITS
            if x in available_splits(args.name, shared_source(s.data_dir, args.name, x))
        ]
    else:
        splits = available_splits(args.name, s.source)
    if not splits:
        where = s.source or s.data_dir
        raise LoopLMError(f"no split of {args.name} found in {where!r}; use --split to name one")
    for split in splits:
        source = s.source
        if s.data_dir:
            source = shared_source(s.data_dir, args.name, split)
        cache = prepare(
            args.name,
            split,
            s.tokenizer,
            source,
            out,
            counts=s.counts,
            tokenizer_path=s.tokenizer_path,
            force=s.force,
        )
        meta = cache.meta
        how = "reused" if cache.reused else f"built in {meta.get('build_seconds', 0):.1f} s"
        print(
            f"{meta['corpus']} {meta['split']}: {meta['n_tokens']:,} tokens, "
            f"{meta['n_documents']:,} documents, {meta['tokenizer']} -> {cache.bin_path} ({how})"
        )
    print(_which_models(s.tokenizer, out, default_cache_dir()))
    return 0


def _which_models(tokenizer: str, out: Path, default: Path) -> str:
    """Which training runs read the caches just prepared: a run reads the caches of its own
    ``model.tokenizer`` from its ``data.cache_dir``."""
    from looplm.settings.config import PRESETS

    users = sorted(n for n, p in PRESETS.items() if p.get("tokenizer", "gpt2") == tokenizer)
    other = "gpt2" if tokenizer == "bytes" else "bytes"
    where = "" if out == default else f" with data.cache_dir={out}"
    return (
        f"prepared for runs with model.tokenizer={tokenizer} (presets {', '.join(users)}){where}; "
        f"a {other} run reads its own caches (prepare them with --tokenizer {other})"
    )


def _info(args: argparse.Namespace) -> int:
    from looplm.data.cache import list_caches

    caches = list_caches(args.dir, verify=from_args(InfoSettings, args).verify)
    if not caches:
        raise LoopLMError(
            f"no token caches in {args.dir!r} (prepare one with `looplm data prepare`)"
        )
    for m in caches:
        src = m.get("source", {})
        where = src.get("path") or f"{src.get('dataset')} {src.get('config') or ''}".strip()
        print(f"{Path(m['bin_path']).name}  [{m['status']}]")
        print(
            f"  corpus {m.get('corpus')}  split {m.get('split')}  tokenizer {m.get('tokenizer')}"
            f" (vocab {m.get('vocab_size')}, eot {m.get('eot_id')})"
        )
        print(
            f"  tokens {m['n_tokens']:,}  documents {m.get('n_documents', 0):,}  dtype "
            f"{m.get('dtype')}  sha256 {str(m.get('bin_sha256'))[:16]}…"
        )
        print(f"  source {src.get('kind')}: {where}  rule {m.get('rule')}")
        print(f"  looplm {m.get('looplm_version')}  created {m.get('created')}")
    bad = [m for m in caches if m["status"] != "ok"]
    if bad:
        print(
            f"error: {len(bad)} of {len(caches)} caches are damaged or stale "
            f"(first: {Path(bad[0]['bin_path']).name}: {bad[0]['status']}); `looplm data prepare` "
            "rebuilds them",
            file=sys.stderr,
        )
        return 1
    return 0
