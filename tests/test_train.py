"""Training: exact resume, atomic/verified checkpoints, a golden loss curve, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from looplm.cli import main
from looplm.errors import LoopLMError
from looplm.model.checkpoint import load_checkpoint, save_checkpoint
from looplm.settings.config import load_config
from looplm.training.loop import fit, get_lr, sample_depth

_CFG_OVERRIDES = [
    "train.steps=6",
    "train.batch_size=8",
    "train.warmup=2",
    "train.log_every=1",
    "eval.n_examples=16",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.dropout=0.1",
    "train.depth_max=3",
]


def _cfg(tmp: Path, *extra: str):
    return load_config("tiny_bool", [*_CFG_OVERRIDES, f"out_dir={tmp}", *extra])


def _losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if "loss" in json.loads(x)]


def test_resume_continues_exactly(tmp_path: Path) -> None:
    full = tmp_path / "full"
    fit(_cfg(full), progress=False)
    # Interrupt after 3 of 6 steps (a callback asks fit to stop), then resume the same 6-step run.
    part2 = tmp_path / "part2"
    cfg = _cfg(part2)
    stopped = fit(cfg, progress=False, callbacks=[lambda ts, m: ts.step == 3])
    assert stopped["stopped"] == "callback" and stopped["step"] == 3
    assert "val_loss" not in stopped  # no final validation when stopped early
    fit(cfg, resume=True, progress=False)
    a, _, meta_a = load_checkpoint(full / "ckpt")
    b, _, meta_b = load_checkpoint(part2 / "ckpt")
    assert meta_a["state"]["step"] == meta_b["state"]["step"] == 6
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    assert _losses(full) == _losses(part2)  # resumed log has no repeated steps either


def test_max_wall_s_stops_with_a_checkpoint_and_resume_finishes(tmp_path: Path) -> None:
    stopped = fit(_cfg(tmp_path, "train.max_wall_s=1e-9"), progress=False)
    assert stopped["stopped"] == "max_wall_s" and stopped["step"] == 1
    _, _, meta = load_checkpoint(tmp_path / "ckpt")
    assert meta["state"]["step"] == 1
    done = fit(_cfg(tmp_path), resume=True, progress=False)
    assert done["step"] == 6 and "stopped" not in done and "val_loss" in done
    with pytest.raises(LoopLMError, match=r"train.max_wall_s=-1.0 must be >= 0"):
        _cfg(tmp_path, "train.max_wall_s=-1")


def test_lr_schedule_and_depth_sampling() -> None:
    cfg = load_config("tiny_bool", ["train.steps=100", "train.warmup=10", "train.lr=1e-3"])
    assert get_lr(0, cfg) == pytest.approx(1e-4)
    assert get_lr(9, cfg) == pytest.approx(1e-3)
    assert get_lr(99, cfg) == pytest.approx(1e-4, rel=0.01)  # min_lr_ratio 0.1
    depths = [sample_depth(s, cfg) for s in range(400)]
    assert set(depths) == set(range(1, 9))
    assert depths == [sample_depth(s, cfg) for s in range(400)]  # same T for every rank/re-run


def test_truncated_checkpoint_is_rejected(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    from looplm.model import model_from_config

    model = model_from_config(cfg.model)
    ck = save_checkpoint(tmp_path / "ck", model, cfg)
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoopLMError, match="truncated"):
        load_checkpoint(ck)
    (ck / "model.safetensors").write_bytes(data[:-4] + b"\0\0\0\0")
    with pytest.raises(LoopLMError, match="sha256"):
        load_checkpoint(ck)
    assert not list(tmp_path.glob(".ck*")), "no temporary folders left behind"


def test_checkpoint_overwrite_keeps_a_complete_folder(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    from looplm.model import model_from_config

    m1 = model_from_config(cfg.model)
    save_checkpoint(tmp_path / "ck", m1, cfg, state={"step": 1})
    m2 = model_from_config(cfg.model)
    save_checkpoint(tmp_path / "ck", m2, cfg, state={"step": 2})
    loaded, _, meta = load_checkpoint(tmp_path / "ck")
    assert meta["state"]["step"] == 2
    assert torch.equal(loaded.tok_emb.weight, m2.tok_emb.weight)


def test_kill_between_the_checkpoint_renames_loses_nothing(tmp_path: Path) -> None:
    """A kill after ``ckpt`` → ``.ckpt.old`` and before ``.ckpt.tmp`` → ``ckpt`` leaves no
    ``ckpt/``; resume (and every reader) finishes the swap and finds the newer checkpoint."""
    import subprocess
    import sys

    out = tmp_path / "run"
    script = f"""
import os, signal
from looplm.model.checkpoint import save_checkpoint
from looplm.settings.config import load_config
from looplm.model import model_from_config
from looplm.training.loop import make_optimizer
cfg = load_config("tiny_bool", {_overrides(out)!r})
model = model_from_config(cfg.model)
opt = make_optimizer(model, cfg, model.tok_emb.weight.device)
save_checkpoint({str(out / "ckpt")!r}, model, cfg, optimizer=opt, state={{"step": 1}})
real = os.replace
def replace(src, dst):
    real(src, dst)
    if str(dst).endswith(".ckpt.old"):  # between the two renames
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
save_checkpoint({str(out / "ckpt")!r}, model, cfg, optimizer=opt, state={{"step": 2}})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (out / "ckpt").exists() and (out / ".ckpt.tmp" / "state.json").exists()
    from looplm.training.loop import setup

    ts = setup(_cfg(out), resume=True)
    assert ts.step == 2  # the newer of the two checkpoints
    assert (out / "ckpt" / "state.json").exists() and not (out / ".ckpt.old").exists()


def _overrides(tmp: Path) -> list[str]:
    return [*_CFG_OVERRIDES, f"out_dir={tmp}"]


# First six training losses of the tiny byte-level SCSE on bool_logic with the settings of _cfg
# (seed 0, CPU, float32), recorded from this implementation. A change to the model, the data
# stream, the initialisation or the optimizer moves them.
GOLDEN = [5.49897, 5.38011, 5.15282, 4.961172, 4.818215, 4.720455]


def test_golden_loss_curve(tmp_path: Path) -> None:
    fit(_cfg(tmp_path, "model.dropout=0.0"), progress=False)
    got = _losses(tmp_path)
    assert got == pytest.approx(GOLDEN, rel=2e-4, abs=2e-5), got


def test_config_written_into_run_folder_and_metrics(tmp_path: Path) -> None:
    fit(_cfg(tmp_path), progress=False)
    written = load_config(str(tmp_path / "config.yaml"))
    assert written.model.d_model == 32 and written.train.steps == 6
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert "val_accuracy" in last and 0.0 <= last["val_accuracy"] <= 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "tiny_bool", "model.recurrence=nope"], "unknown recurrence 'nope'; allowed"),
        (["train", "tiny_bool", "train.bogus=1"], "unknown config key train.bogus"),
        (["train", "tiny_bool", "train.steps=abc"], "train.steps='abc' must be an integer"),
        (["train", "missing.yaml"], "config 'missing.yaml' not found"),
        (["eval", "/nonexistent/ckpt"], "does not exist"),
        (["eval", "x", "--depths", "0,4"], "loop depths must be integers >= 1"),
        (["demo", "--methods", "nope"], "unknown method 'nope'"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_cli_corrupt_checkpoint_exit_2(tmp_path: Path, capsys) -> None:
    cfg = _cfg(tmp_path)
    from looplm.model import model_from_config

    ck = save_checkpoint(tmp_path / "ck", model_from_config(cfg.model), cfg)
    blob = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(blob[:100])
    assert main(["eval", str(ck), "--depths", "1"]) == 2
    assert "truncated" in capsys.readouterr().err


def test_cli_train_and_eval_roundtrip(tmp_path: Path, capsys) -> None:
    overrides = [
        "train.steps=2",
        "train.batch_size=4",
        "model.d_model=32",
        "model.n_heads=2",
        "model.d_ff=64",
        "eval.n_examples=8",
        f"out_dir={tmp_path}",
    ]
    assert main(["train", "tiny_bool", *overrides, "--no-progress"]) == 0
    capsys.readouterr()
    assert (
        main(["eval", str(tmp_path / "ckpt"), "--depths", "1,3", "--out", str(tmp_path / "e.json")])
        == 0
    )
    res = json.loads((tmp_path / "e.json").read_text())
    assert [r["depth"] for r in res["results"]] == [1, 3]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in res["results"])


def test_unshared_trains_all_layers_every_step(tmp_path: Path) -> None:
    from looplm.training.loop import setup, train_step

    cfg = _cfg(tmp_path, "model.recurrence=unshared", "model.n_layers=4")
    ts = setup(cfg)
    for _ in range(3):
        m = train_step(ts)
        assert m["loops"] == 4
        assert all(p.grad is not None for p in ts.model.layers[3].parameters())


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.clip=0", "train.clip=0.0 must be > 0"),
        ("train.beta2=1.5", "train.beta2=1.5 must be in [0, 1)"),
        ("train.min_lr_ratio=-1", "train.min_lr_ratio"),
        ("train.ckpt_every=-1", "train.ckpt_every=-1 must be >= 0"),
        ("eval.depths=[]", "eval.depths is empty"),
    ],
)
def test_config_rejects_dangerous_values(override: str, message: str) -> None:
    with pytest.raises(LoopLMError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_config("tiny_bool", [override])
