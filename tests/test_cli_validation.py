"""One-line errors naming the bad value for the inputs a new user gets wrong, a report that
says how to use the seeds a store has, and `generate` that streams instead of allocating up
front."""

from __future__ import annotations

import json

import pytest
import torch
from test_faults import one_line_error, train_cli, write_text

from looplm.cli import main
from looplm.errors import LoopLMError
from looplm.results.store import EvalRecord, ResultsStore


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    assert train_cli(tmp, str(tmp / "run"), 2) == 0
    return tmp / "run" / "ckpt"


@pytest.mark.parametrize(
    "argv, named",
    [
        (["eval", "{ckpt}", "--depths", "1,,2"], "'1,,2'"),
        (["eval", "{ckpt}", "--batch-size", "0"], "--batch-size=0"),
        (["eval", "{ckpt}", "--max-tokens", "-5"], "--max-tokens=-5"),
        (["generate", "{ckpt}", "--prompt", "a", "--temperature", "-1"], "--temperature -1"),
        (["generate", "{ckpt}", "--prompt", "a", "--temperature", "nan"], "--temperature nan"),
        (["generate", "{ckpt}", "--prompt", "a", "--top-k", "0"], "--top-k 0"),
        (["generate", "{ckpt}", "--prompt", "caf\udcc3"], "byte c3"),
        (["train", "own_text", "train.lr=nan"], "train.lr=nan"),
        (["train", "own_text", "train.clip=.inf"], "train.clip=inf"),
    ],
)
def test_bad_values_are_one_line_errors_naming_them(ckpt, capsys, argv, named):
    assert main([a.format(ckpt=ckpt) for a in argv]) == 2
    assert named in one_line_error(capsys.readouterr().err)


def test_a_yaml_error_is_one_line_with_its_position(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n train: [1, 2\n")
    assert main(["train", str(bad)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "not valid YAML" in line and "line 3" in line


def test_data_info_verify_fails_on_a_corrupt_cache(tmp_path, capsys):
    text = write_text(tmp_path / "story.txt")
    out = tmp_path / "cache"
    assert main(["data", "prepare", f"text:{text}", "--tokenizer", "bytes", "--out", str(out)]) == 0
    assert main(["data", "info", str(out), "--verify"]) == 0
    binfile = sorted(out.glob("*.train.bytes.bin"))[0]
    data = bytearray(binfile.read_bytes())
    data[10] ^= 1  # same size, one flipped bit: only the checksum sees it
    binfile.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["data", "info", str(out), "--verify"]) == 1
    assert "checksum" in one_line_error(capsys.readouterr().err)


def test_resume_names_the_model_setting_that_differs(tmp_path, capsys):
    assert train_cli(tmp_path, str(tmp_path / "run"), 2) == 0
    capsys.readouterr()
    assert train_cli(tmp_path, str(tmp_path / "run"), 4, "--resume", "model.d_ff=128") == 2
    line = one_line_error(capsys.readouterr().err)
    assert "model.d_ff=128" in line and "64" in line


@pytest.mark.parametrize("steps", [1, 2])
def test_resume_with_no_steps_left_is_refused(tmp_path, capsys, steps):
    assert train_cli(tmp_path, str(tmp_path / "run"), 2) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    capsys.readouterr()
    assert train_cli(tmp_path, str(tmp_path / "run"), steps, "--resume") == 2
    line = one_line_error(capsys.readouterr().err)
    assert "step 2" in line and f"train.steps={steps}" in line
    assert (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() == lines


def test_report_on_a_one_seed_store_names_the_flags(tmp_path, capsys):
    path = tmp_path / "results.sqlite"
    with ResultsStore(path) as st:
        for method in ("scse", "looped"):
            for depth in (1, 2):
                st.put(
                    EvalRecord(
                        model_hash=method,
                        method=method,
                        protocol="p",
                        dataset="d",
                        split="test",
                        depth=depth,
                        seed=0,
                        n_tokens=100,
                        sum_nll=300.0,
                    )
                )
    assert main(["report", str(path), "--no-figures"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "--seeds" in line and "--allow-incomplete" in line
    assert main(["report", str(path), "--no-figures", "--seeds", "all"]) == 0


def test_generate_streams_and_does_not_allocate_up_front(ckpt, capsys, monkeypatch):
    """A billion tokens asked for: the first ones are printed as they come, and Ctrl-C (here
    after five tokens) stops at once."""
    from looplm.decoding import decoder as generate

    real, calls = generate.next_logits, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "next_logits", counted)
    monkeypatch.setattr(
        torch,
        "full",
        lambda *a, **k: (
            pytest.fail("no up-front buffer")
            if a[0][-1] > 10**6
            else torch.ones(*a[:1], **{k_: v for k_, v in k.items() if k_ != "fill_value"}) * a[1]
        ),
    )
    code = main(["generate", str(ckpt), "--prompt", "The ", "--max-new", "1000000000"])
    out = capsys.readouterr()
    assert code == 130 and "interrupted" in out.err
    assert out.out.startswith("The ") and len(out.out.encode("utf-8")) >= len("The ") + 4


def test_generate_streamed_text_is_the_decoded_continuation(ckpt, capsys):
    from looplm.data import get_tokenizer
    from looplm.decoding.decoder import decode
    from looplm.model.checkpoint import load_checkpoint

    assert main(["generate", str(ckpt), "--prompt", "The ", "--max-new", "12"]) == 0
    streamed = capsys.readouterr().out.splitlines()[0]
    model, cfg, _ = load_checkpoint(ckpt)
    tok = get_tokenizer(cfg.model.tokenizer)
    ids = torch.tensor([tok.encode("The ")])
    assert streamed == tok.decode(decode(model, ids, 12).tokens[0].tolist()).split("\n")[0]
    json.dumps(streamed)


def test_off_and_no_stay_words_in_overrides_and_config_files(tmp_path) -> None:
    # YAML 1.1 reads off/on/yes/no as booleans: `train.autocast=off` became the string 'False'
    from looplm.settings.config import load_config

    cfg = load_config("tiny_bool", ["train.autocast=off", "train.compile=false"])
    assert cfg.train.autocast == "off" and cfg.train.compile is False
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny}\ntrain: {autocast: off, steps: 3}\n")
    assert load_config(str(path)).train.autocast == "off"
    with pytest.raises(LoopLMError, match="train.compile='yes' must be true or false"):
        load_config("tiny_bool", ["train.compile=yes"])
