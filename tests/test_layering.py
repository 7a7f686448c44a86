"""Architecture rules checked on the source: imports flow one way, files and functions stay
readable, and the package's lazy attributes work."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "looplm"
# The package order, lowest first: a module imports only from its own package or from a lower
# floor; packages on one floor do not import each other. Data flows one way: settings → model /
# data → training → evaluation and decoding → the analyses → experiments → the command line.
FLOORS = (
    ("errors",),
    ("io", "device", "progress", "signals", "targets"),
    ("settings",),
    ("model", "data", "results"),
    ("training", "evaluate", "decoding"),
    ("adaptive", "diagnostics", "frontier", "lambada", "lens", "scaling", "transfer"),
    ("experiments",),
    ("commands",),
    ("cli",),
    ("__main__",),
)
ROOT_MODULES = {
    "__init__",
    "__main__",
    "cli",
    "device",
    "errors",
    "io",
    "progress",
    "signals",
    "targets",
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _room(path: Path) -> str:
    """The package (or root module) a file belongs to: ``model``, ``errors``, …"""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _floor(room: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"{room!r} is on no floor of FLOORS: place it there")


def test_the_root_holds_only_the_package_face_and_shared_helpers():
    """Everything else sits in a package named for what it does."""
    loose = sorted(f.stem for f in ROOT.glob("*.py"))
    assert set(loose) <= ROOT_MODULES, sorted(set(loose) - ROOT_MODULES)


def test_imports_run_down_the_floors_only():
    """No import runs back up a floor or sideways into another package on the same floor
    (imports inside functions count)."""
    back = []
    for f in sorted(ROOT.rglob("*.py")):
        room = _room(f)
        if room == "__init__":
            continue
        for name in _imports(f):
            parts = name.split(".")
            if parts[0] != "looplm" or len(parts) < 2:
                continue
            target = parts[1]
            if (
                target == room
                or not (ROOT / target).exists()
                and not (ROOT / f"{target}.py").exists()
            ):
                continue
            if _floor(target) >= _floor(room):
                back.append(f"{f.relative_to(ROOT)} -> {name}")
    assert not back, back


def test_no_module_only_hands_on_another():
    """No re-export shim: a module that only imports names (or swaps itself for another module in
    ``sys.modules``) would keep an old path alive after a move; callers import the real module."""
    shims = []
    for f in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(f.read_text())
        body = [
            n
            for n in tree.body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        ]
        text = f.read_text()
        if "sys.modules[__name__]" in text or "import *" in text:
            shims.append(str(f.relative_to(ROOT)))
        elif body and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body):
            shims.append(str(f.relative_to(ROOT)))
    assert not shims, shims


@pytest.mark.parametrize("lower", ["model", "settings/config.py"])
def test_the_model_and_the_config_never_import_data(lower):
    """The model and its settings know nothing of datasets (imports inside functions count)."""
    path = ROOT / lower
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert files
    for f in files:
        for name in _imports(f):
            assert not name.startswith("looplm.data"), (str(f.relative_to(ROOT)), name)


def test_looplm_subpackages_are_attributes():
    code = "import looplm; print(len(looplm.data.CORPORA) > 0, looplm.results.EvalRecord.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "EvalRecord"]
    import looplm

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        looplm.nope  # noqa: B018


def test_key_value_settings_may_follow_an_option():
    from looplm.cli import parse_args

    args = parse_args(["train", "tiny_bool", "out_dir=X", "--resume", "train.steps=3"])
    assert args.resume and args.overrides == ["out_dir=X", "train.steps=3"]
    args = parse_args(["params", "--method", "hyper_scse", "lanes=2", "--json", "dropout=0"])
    assert args.settings == ["lanes=2", "dropout=0"]
    with pytest.raises(SystemExit):
        parse_args(["train", "tiny_bool", "--resume", "--bogus"])


# A smell alarm, not a gate: a file is as long as its one idea needs, but one over 900 lines (or a
# function over 60) says why in a ``# long: <why>`` comment, so a reader knows it was meant.
ALARM_FILE_LINES, PLAIN_FUNCTION_LINES = 900, 60


def test_files_over_900_lines_say_why():
    """A module over 900 lines carries a ``# long: <why>`` comment at module level (before its
    first definition): split it where its ideas part, never to fit a number."""
    unexplained = []
    for f in sorted(ROOT.rglob("*.py")):
        text = f.read_text()
        if text.count("\n") <= ALARM_FILE_LINES:
            continue
        tree = ast.parse(text)
        first = min(
            (
                n.lineno
                for n in tree.body
                if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr))
            ),
            default=1,
        )
        head = text.splitlines()[: first - 1]
        if not any(re.match(r"# long: \S", line.strip()) for line in head):
            unexplained.append(f"{f.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not unexplained, unexplained


def test_functions_over_60_lines_say_why():
    """A function over 60 lines (definition to last line) has a ``# long: <why>`` comment on the
    line above its definition (or its decorators)."""
    unexplained = []
    for f in sorted(ROOT.rglob("*.py")):
        text = f.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 <= PLAIN_FUNCTION_LINES:
                    continue
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                above = lines[first - 2].strip() if first >= 2 else ""
                if not re.match(r"# long: \S", above):
                    unexplained.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not unexplained, unexplained


# A hand-written unroll outside the model: a recurrence stepped, started or read out directly.
OWN_UNROLL = re.compile(r"\binit_state\(|\b(?:rec|recurrence)\.step\(|\.(?:to|from)_hidden\(")
# A second per-token halting mechanism: frozen-state merges belong to looplm/model/halting.py.
OWN_HALTING = re.compile(r"def _?token_mask|class _?KeysValuesOnly|class PreviousReadout")
# A scorer of its own: hidden states → NLL / hits go through LanguageModelBase.score.
OWN_SCORER = re.compile(r"\bnorm_f\(|\breadout_nll\(|\blinear_(?:nll_and_correct|cross_entropy)\(")
IGNORE_LITERAL = re.compile(r"(?<![\w.])-100\b")
# The vLLM model's readout: its final norm feeds vLLM's tensor-parallel head (logits for vLLM's
# sampler, gathered over ranks), which looplm's single-device readout cannot produce.
OWN_READOUT = {Path("decoding/vllm/model.py")}


def test_one_unroll_one_halting_one_scorer_one_ignore_index():
    """Every caller runs ``model.unroll`` (with a halting object from looplm.model.halting) instead
    of its own loop over ``recurrence.step``; per-token halting has one implementation; hidden
    states are scored by ``model.score``; unscored targets are written ``IGNORE_INDEX``."""
    found = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        for i, line in enumerate(f.read_text().splitlines(), 1):
            scorer = OWN_SCORER.search(line) and rel not in OWN_READOUT
            if rel.parts[0] != "model" and (OWN_UNROLL.search(line) or scorer):
                found.append(f"{rel}:{i}: {line.strip()}")
            if rel != Path("targets.py") and IGNORE_LITERAL.search(line):
                found.append(f"{rel}:{i}: {line.strip()} (use looplm.targets.IGNORE_INDEX)")
            if rel != Path("model/halting.py") and OWN_HALTING.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, found


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module → the looplm modules it imports (at any depth of its code, functions included);
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    files = {_module_name(f): f for f in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        deps = set()
        for name in _imports(f):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod and name.startswith("looplm."):
                deps.add(name)
        graph[mod] = deps
    return graph


def test_no_import_circles_inside_the_package():
    """No two modules of looplm import each other, directly or through others (a package's
    ``__init__`` that only hands names on counts like any module)."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


COMMAND_FILES = sorted((ROOT / "commands").glob("*.py")) + sorted(ROOT.glob("*/command.py"))
MAX_COMMAND_LINES = 800


def test_only_the_command_line_imports_the_commands():
    """Nothing but ``looplm.cli`` (and the commands themselves) imports ``looplm.commands``:
    domain code never reaches into the command line for its logic."""
    found = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[0] == "commands" or rel in (Path("cli.py"), Path("__main__.py")):
            continue
        found += [f"{rel}: {n}" for n in _imports(f) if n.startswith("looplm.commands")]
    assert not found, found


def test_commands_are_thin():
    """The commands parse (options made from settings dataclasses), call the library and print:
    ``looplm/commands/`` stays under 800 lines, and a command module defines no class of its
    own and imports the library only inside the function that runs (start-up stays light)."""
    here = sorted((ROOT / "commands").glob("*.py"))
    total = sum(f.read_text().count("\n") for f in here)
    assert total < MAX_COMMAND_LINES, total
    light = ("looplm.errors", "looplm.settings.options", "looplm.settings")
    for f in COMMAND_FILES:
        tree = ast.parse(f.read_text())
        assert not [n for n in tree.body if isinstance(n, ast.ClassDef)], f
        for node in tree.body:  # module level: settings modules and the option maker only
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("looplm"):
                mod = node.module or ""
                assert (
                    mod.startswith(light)
                    or mod.endswith(".settings")
                    or mod in ("looplm.decoding.generate",)
                ), (str(f.relative_to(ROOT)), mod)
