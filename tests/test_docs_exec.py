"""Every shell command and Python block in README.md and docs/*.md runs as written.

Pages run in one fresh folder, README.md first, then docs/*.md by name, blocks in page order: the
way a reader runs them, so a later block uses what an earlier one wrote (the tour's
``runs/tour/ckpt`` serves every page after it). Clean-clone conditions: no ``../shared`` beside
the folder, ``LOOPLM_DATA_DIR`` unset, HOME and every cache inside the temp folder. Training is
shortened the documented way only: ``LOOPLM_MAX_STEPS`` (README, "Running the docs") caps each
training run's steps; the text itself runs unchanged.

Mark-up, an HTML comment on the line right above a fence (invisible when the page renders; the
prose beside the block tells the reader the same thing):

    <!-- docs-test: skip REASON -->      not run; REASON is counted and printed per reason
    <!-- docs-test: needs-data -->       run only with the real corpora present
                                         (LOOPLM_DATA_DIR, or ../shared/data beside the checkout)
    <!-- docs-test: file PATH -->        the block is that file's content: written, then run

```bash`` / ```sh`` blocks run under ``bash -e -o pipefail``, ```python`` blocks under Python;
any other fence (yaml, text, none) shows contents or output and is not run. A page this test has
never seen is collected the same way. docs/contributing.md says the same for writers of pages.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import data_dir

REPO = Path(__file__).resolve().parents[1]
RUN_LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
MARK = re.compile(r"<!--\s*docs-test:\s*(skip|needs-data|file)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
STEP_CAP = os.environ.get("LOOPLM_MAX_STEPS", "10")  # the docs run's default cap
BLOCK_TIMEOUT_S = 1800  # a busy shared machine runs the tour several times slower


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None = None  # the text's own reason
    needs_data: bool = False
    file: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def collect(path: Path) -> list[Block]:
    """The runnable fenced blocks of one page with the mark-up right above each."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        lang = RUN_LANGS.get(m.group(1).lower())
        if lang is None:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        block = Block(
            str(path.relative_to(REPO)), text[: m.start()].count("\n") + 1, lang, m.group(2)
        )
        mark = MARK.search(before)
        if mark:
            kind, arg = mark.groups()
            if kind == "skip":
                assert arg, f"{block.id}: a skip mark needs a reason"
                block.skip = arg
            elif kind == "needs-data":
                block.needs_data = True
            else:
                assert arg, f"{block.id}: a file mark needs a path"
                block.file = arg
        out.append(block)
    return out


BLOCKS = [b for p in pages() for b in collect(p)]
SKIPPED: Counter[str] = Counter()


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The reader's folder and environment, shared by every block (in order)."""
    root = tmp_path_factory.mktemp("reader")
    work = root / "work"
    work.mkdir()
    home = root / "home"
    (home / ".cache").mkdir(parents=True)
    # a `looplm` on PATH that runs this checkout whatever PYTHONPATH a block sets
    bin_dir = root / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "looplm"
    launcher.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(1, {str(REPO)!r})\n"
        "from looplm.cli import main\nsys.exit(main())\n"
    )
    launcher.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    drop = ("LOOPLM_DATA_DIR", "LOOPLM_CACHE_DIR", "LOOPLM_PLUGINS", "XDG_CACHE_HOME", "HF_HOME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
        PYTHONPATH=str(REPO),
        LOOPLM_MAX_STEPS=STEP_CAP,
        LOOPLM_NO_PROGRESS="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",  # a clean machine may be offline; blocks that download are marked
        MPLBACKEND="Agg",
    )
    return work, env


def test_every_page_is_collected() -> None:
    """README.md and every docs page are read; the README's tour is among the runnable blocks."""
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/methods.md"}
    tour = [b for b in BLOCKS if b.page == "README.md" and "looplm train tiny_bool" in b.code]
    assert tour and tour[0].skip is None


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_written(block: Block, reader: tuple[Path, dict[str, str]]) -> None:
    work, env = reader
    if block.skip:
        SKIPPED[block.skip] += 1
        pytest.skip(f"{block.id}: {block.skip} (the page says so)")
    if block.needs_data:
        data = data_dir()
        if not data.is_dir():
            SKIPPED["needs the real corpora (README 'Real data')"] += 1
            pytest.skip(f"{block.id}: needs the real corpora at {data} (README 'Real data')")
        env = {**env, "LOOPLM_DATA_DIR": str(data)}
    if block.file:
        target = work / block.file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
        cmd = [sys.executable, str(target)]
    elif block.lang == "python":
        cmd = [sys.executable, "-c", block.code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    proc = subprocess.run(
        cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert proc.returncode == 0, (
        f"{block.id} ({block.lang}) exited {proc.returncode}\n--- block\n{block.code}"
        f"--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}"
    )


def skip_summary() -> list[str]:
    """How many blocks each reason kept from running (conftest prints it after the run)."""
    if not SKIPPED:
        return []
    lines = [f"docs blocks: {len(BLOCKS)} runnable, {sum(SKIPPED.values())} skipped"]
    return lines + [f"  {n} x {reason}" for reason, n in SKIPPED.most_common()]
