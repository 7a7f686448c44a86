"""Decoding throughput of this tree's ``looplm.decoding.decoder`` against another tree's, in one process.

    python benchmarks/generation_ab.py BEFORE_TREE [--reps 40]

The other tree's ``looplm/decoding/decoder.py`` is loaded as a module of its own on top of this tree's
package (it must import only names this tree still provides), so both decode with the same model
object in the same process, alternating call by call: machine load from other work then hits both
alike, which separate processes (``compare_trees.py``) cannot guarantee on a shared machine. A
randomly initialised tiny SCSE model (one torch thread) decodes 8 × 32 prompts → 96 tokens at
T = 8, fixed depth and with per-token KL (1e-3) and update (0.3) halting; both versions must
produce the same tokens and depths. Reported: min and median process CPU time per call, and the
throughput ratio after / before (= before time / after time).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = (("none", 0.0), ("kl", 1e-3), ("maxtoken", 0.3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="source tree whose looplm/decoding/decoder.py is 'before'")
    ap.add_argument("--reps", type=int, default=40, help="calls per version and mode")
    args = ap.parse_args(argv)
    import torch

    import looplm
    import looplm.decoding.decoder as after

    torch.set_num_threads(1)
    path = Path(args.before) / "looplm" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_before", path)
    before = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = before
    spec.loader.exec_module(before)
    torch.manual_seed(0)
    model = looplm.build_model("tiny", "scse", dropout=0.0).eval()
    prompt = torch.randint(0, 257, (8, 32), generator=torch.Generator().manual_seed(1))
    versions = {"before": before, "after": after}
    print("| mode | before min / median (s) | after min / median (s) | after/before tokens/s, "
          "min / median |")  # fmt: skip
    print("| --- | ---: | ---: | ---: |")
    for mode, thr in MODES:
        outs = [v.decode(model, prompt, 96, 8, halt=mode, threshold=thr) for v in versions.values()]
        assert torch.equal(outs[0].tokens, outs[1].tokens) and torch.equal(
            outs[0].loops, outs[1].loops
        )
        t: dict[str, list[float]] = {k: [] for k in versions}
        for i in range(args.reps):
            order = list(versions) if i % 2 == 0 else list(versions)[::-1]
            for k in order:
                c = time.process_time()
                versions[k].decode(model, prompt, 96, 8, halt=mode, threshold=thr)
                t[k].append(time.process_time() - c)
        b, a = t["before"], t["after"]
        mb, ma = statistics.median(b), statistics.median(a)
        print(f"| {mode} | {min(b):.3f} / {mb:.3f} | {min(a):.3f} / {ma:.3f} | "
              f"{min(b) / min(a):.3f} / {mb / ma:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
