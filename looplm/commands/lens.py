"""`looplm lens CHECKPOINT --out DIR`: the Jacobian lens of a looped (or unshared) checkpoint.

Fits J_t = E Σ_{p'≥p} ∂h_T[p'] / ∂h_t[p] at depth T and at deeper, extrapolated depths, trains a
tuned lens, measures the fidelity of the J-lens, the logit lens and the tuned lens per loop step on
held-out prompts, the workspace structure and a coordinate-swap dose-response, and writes
``DIR/lens.json``, the fitted lenses and the figures (``lens_slice.png``/``.html``,
``lens_fidelity.png``, ``lens_angles.png``, ``lens_dose.png``). See docs/lens.md.
"""

from __future__ import annotations

import argparse

from looplm.commands import checkpoint_data
from looplm.errors import LoopLMError


# long: one argparse option per setting, each with its help text
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lens",
        help="Jacobian lens: fit J_t per loop step, readout fidelity, workspace, interventions",
        description=(
            "Fit the Jacobian lens of a checkpoint at depth T (and at extrapolated depths), "
            "compare it with the logit lens and a tuned lens per loop step on held-out prompts, "
            "measure the workspace structure and a coordinate-swap dose-response, and write "
            "lens.json, the lenses and the figures into --out."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--loops",
        type=int,
        help="depth T of the fit (default: the largest training depth; an unshared model's "
        "layer count)",
    )
    p.add_argument("--prompts", type=int, default=16, help="fitting prompts (default 16)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts (default 32)")
    p.add_argument(
        "--extrapolate",
        default="24,48",
        help="comma-separated deeper depths to fit and evaluate too ('' for none; default 24,48; "
        "unshared models: none)",
    )
    p.add_argument("--mode", default="exact", help="estimator at T: exact | hutchinson")
    p.add_argument(
        "--extrapolate-mode",
        default="exact",
        help="estimator at the extrapolated depths: exact | hutchinson (default exact)",
    )
    p.add_argument("--probes", type=int, default=16, help="Hutchinson probes per prompt")
    p.add_argument(
        "--skip-positions", type=int, default=0, help="leave the first positions out as sources"
    )
    p.add_argument("--k", type=int, default=8, help="subspace dimension (default 8)")
    p.add_argument(
        "--band",
        help="intervention band FIRST,LAST of loop steps (default: 38–92%% of T, the original "
        "study's workspace band)",
    )
    p.add_argument("--tuned-steps", type=int, default=100, help="tuned-lens Adam steps")
    p.add_argument(
        "--lens", help="a saved Jacobian lens (lens_T{T} folder) to use at T instead of fitting"
    )
    p.add_argument(
        "--interventions",
        default="swap",
        help="comma-separated dose-responses: swap, steer, project (default swap; '' for none)",
    )
    p.add_argument("--no-composition", action="store_true", help="skip the one-step Jacobians")
    checkpoint_data.add_data_options(
        p,
        data_help="corpus or synthetic task (default: the checkpoint's own)",
        split_help="split to draw prompts from (default: the run's eval split)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="prompts per batch (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of probes, subsamples, bootstrap")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--no-plots", action="store_true", help="write numbers only")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise LoopLMError(f"{what} {text!r}: expected comma-separated integers") from None


def _check_args(args: argparse.Namespace) -> None:
    for name in ("prompts", "eval_prompts", "batch_size", "probes", "k", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise LoopLMError(f"--{name.replace('_', '-')} {v} must be >= 1")
    if args.loops is not None and args.loops < 1:
        raise LoopLMError(f"--loops {args.loops}: the loop depth T must be an integer >= 1")
    from looplm.limits import check_loops, check_output_folder

    check_output_folder("--out", args.out)  # before the fit, not after it
    if args.loops is not None:
        check_loops("--loops", args.loops, offer_flag=False)
    if args.tuned_steps < 0:
        raise LoopLMError(f"--tuned-steps {args.tuned_steps} must be >= 0")


def _batches(cfg, args, n_prompts: int, n_eval: int):
    """Disjoint fitting and held-out batches from one stream of the checkpoint's data."""
    bs = min(args.batch_size, n_prompts, n_eval)
    n_fit, n_ev = -(-n_prompts // bs), -(-n_eval // bs)
    batches, info, pad_id = checkpoint_data.load_data_batches(
        cfg, args, batch_size=bs, n_batches=n_fit + n_ev, seed=args.seed + 1
    )
    if len(batches) < n_fit + n_ev:
        raise LoopLMError(
            f"{info['dataset']} gave {len(batches)} batches of {bs}; {n_fit + n_ev} needed for "
            f"{n_prompts} fitting and {n_eval} held-out prompts"
        )
    return batches[:n_fit], batches[n_fit:], info, pad_id


def run(args: argparse.Namespace) -> int:
    from looplm.checkpoint import load_checkpoint
    from looplm.diagnostics.lens import JacobianLens
    from looplm.diagnostics.lens_run import LensOptions, analyse_lens

    _check_args(args)
    checkpoint_data.set_threads(args.threads)
    model, cfg, _ = load_checkpoint(args.checkpoint)
    looped = cfg.model.is_looped
    loops = args.loops or (cfg.train.depth_max if looped else cfg.model.n_layers)
    extra = _ints(args.extrapolate, "--extrapolate") if looped else ()
    band = _ints(args.band, "--band") if args.band else None
    if band is not None and len(band) != 2:
        raise LoopLMError(f"--band {args.band!r}: expected FIRST,LAST")
    lens = None
    if args.lens:
        lens = JacobianLens.load(args.lens)
        lens.check_model(model, loops)
    opts = LensOptions(
        loops=loops,
        extrapolate=extra,
        mode=args.mode,
        extrapolate_mode=args.extrapolate_mode,
        probes=args.probes,
        skip_positions=args.skip_positions,
        tuned_steps=args.tuned_steps,
        k=args.k,
        band=band,
        composition=not args.no_composition,
        interventions=tuple(k.strip() for k in args.interventions.split(",") if k.strip()),
        seed=args.seed,
        plots=not args.no_plots,
    )
    opts.validate(model)
    fit_b, eval_b, info, pad_id = _batches(cfg, args, args.prompts, args.eval_prompts)
    opts.corpus = f"{info['dataset']}/{info['split']}"
    # without a tokenizer the slice shows token ids
    tokenizer, _ = checkpoint_data.checkpoint_tokenizer(cfg)
    result = analyse_lens(
        model, fit_b, eval_b, args.out, opts, pad_id=pad_id, tokenizer=tokenizer, lens=lens
    )
    _print_summary(result)
    return 0


def _print_summary(result: dict) -> None:
    T = result["loops"]
    print(
        f"lens of {result['family']} at T={T} on {result['n_fit_prompts']} prompts "
        f"({result['n_eval_prompts']} held out)"
    )
    for depth, fid in result["fidelity"].items():
        arms = fid["arms"]
        kl = {a: [r["mean"] for r in arms[a]["kl"]] for a in arms}
        band = fid["band"]["kl"]["steps"]
        mid = int(depth) // 2
        line = ", ".join(f"{a} {kl[a][mid]:.3g}" for a in arms)
        print(f"  T={depth}: KL at t={mid}: {line}; J beats logit (KL) at steps {band or 'none'}")
    iv = result["interventions"]
    if "swap" not in iv:
        print(f"  wrote {result['out']}lens.json in {result['seconds']['total']:.0f} s")
        return
    sw = iv["swap"]["jacobian"]
    i1 = sw["strengths"].index(1.0) if 1.0 in sw["strengths"] else -1
    print(
        f"  swap over steps {iv['band'][0]}–{iv['band'][1]} (J-lens): top-1 → runner-up "
        f"{sw['target']['to_rival'][i1]:.2f}, control pair {sw['control']['to_rival'][i1]:.2f}"
    )
    print(f"  wrote {result['out']}lens.json in {result['seconds']['total']:.0f} s")
