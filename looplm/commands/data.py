"""`looplm data prepare NAME ...` and `looplm data info DIR`: build and inspect token caches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from looplm.errors import LoopLMError


def register(subparsers) -> None:
    """Add the ``data`` command with its ``prepare`` and ``info`` actions."""
    from looplm.data.corpora import CORPORA
    from looplm.data.tokenizers import TOKENIZER_NAMES

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
    pp.add_argument("--source", default=None, help="local copy of the corpus (file or folder)")
    pp.add_argument(
        "--data-dir",
        default=None,
        help="a folder laid out like the shared data (data_dir/wikitext-2, ...) instead of --source",
    )
    pp.add_argument(
        "--split",
        nargs="+",
        action="extend",
        default=None,
        metavar="S",
        help="splits to prepare (default: every split the source has)",
    )
    pp.add_argument("--tokenizer", default="gpt2", choices=TOKENIZER_NAMES)
    pp.add_argument("--tokenizer-path", default=None, help="folder with GPT-2 tokenizer files")
    pp.add_argument(
        "--out", default=None, help="cache folder (default $LOOPLM_CACHE_DIR or ~/.cache/looplm)"
    )
    pp.add_argument(
        "--counts",
        default=None,
        metavar="TRAIN,VALID,TEST",
        help="document counts of the openwebtext / c4 splits (default: the paper's)",
    )
    pp.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    pp.set_defaults(func=_prepare)

    pi = sub.add_parser("info", help="print the metadata of the token caches in a folder")
    pi.add_argument("dir", metavar="DIR")
    pi.add_argument("--verify", action="store_true", help="also check each token file's sha256")
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
    if args.source and args.data_dir:
        raise LoopLMError("give either --source or --data-dir, not both")
    out = Path(args.out).expanduser() if args.out else default_cache_dir()
    from looplm.settings.limits import check_output_folder

    check_output_folder("--out", out)  # before tokenizing
    if args.split:
        splits = list(dict.fromkeys(canonical_split(s) for s in args.split))
    elif args.data_dir:  # the splits whose files the data folder has
        splits = [
            s
            for s in SPLITS
            if s in available_splits(args.name, shared_source(args.data_dir, args.name, s))
        ]
    else:
        splits = available_splits(args.name, args.source)
    if not splits:
        where = args.source or args.data_dir
        raise LoopLMError(f"no split of {args.name} found in {where!r}; use --split to name one")
    for split in splits:
        source = args.source
        if args.data_dir:
            source = shared_source(args.data_dir, args.name, split)
        cache = prepare(
            args.name,
            split,
            args.tokenizer,
            source,
            out,
            counts=args.counts,
            tokenizer_path=args.tokenizer_path,
            force=args.force,
        )
        meta = cache.meta
        how = "reused" if cache.reused else f"built in {meta.get('build_seconds', 0):.1f} s"
        print(
            f"{meta['corpus']} {meta['split']}: {meta['n_tokens']:,} tokens, "
            f"{meta['n_documents']:,} documents, {meta['tokenizer']} -> {cache.bin_path} ({how})"
        )
    print(_which_models(args.tokenizer, out, default_cache_dir()))
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

    caches = list_caches(args.dir, verify=args.verify)
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
