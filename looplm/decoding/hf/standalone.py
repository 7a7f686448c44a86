"""One self-contained ``modeling_looplm.py``, generated from looplm's own source at export time.

``looplm export --standalone`` writes this file instead of the thin wrapper that imports looplm: it
is the wrapper (:mod:`looplm.decoding.hf.modeling_looplm`) with every looplm definition it reaches pasted
above it, so the folder loads where only ``torch`` and ``transformers`` are installed. The model
code keeps one home (the looplm package); the generated file is a build product.

How it is built (:func:`standalone_source`), on the syntax trees of the modules:

1. **Roots**: every top-level definition of the wrapper, and every module a package scan
   (``import_submodules(__name__, __path__)``, the recurrence registry's) would import, since those
   register themselves rather than being referenced.
2. **Closure**: a definition depends on each name it mentions that is a top-level definition of its
   module, or a name its module (or one of its functions) imports from looplm — followed through
   re-exports to the module that defines it. External imports (torch, dataclasses, …) are kept
   once at the top.
3. **Order**: module by module as the imports first reach them, each in source order, moved only
   where a definition needs another one *while it is being defined* (a base class, a decorator, a
   default value, a module-level call and whatever that call reaches).
4. **Checks**: two definitions of one name, an import alias that renames a looplm name, a name
   that would shadow a builtin another definition uses, or a module import of a looplm package
   stop the export with :class:`~looplm.errors.LoopLMError`; the result is compiled before it is
   written.

Imports of looplm names inside functions are dropped (the definitions are in the same file);
other statements at a module's top level (calls with side effects, ``__all__``) are not copied.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

from looplm.errors import LoopLMError

ROOT_MODULE = "looplm.decoding.hf.modeling_looplm"
PACKAGE = "looplm"
SCAN_CALL = "import_submodules"

__all__ = ["standalone_source"]


def _is_looplm(module: str | None) -> bool:
    return module is not None and (module == PACKAGE or module.startswith(PACKAGE + "."))


@dataclass
class _Module:
    """One parsed looplm module: its top-level definitions and what its imports bind."""

    name: str
    path: Path
    source: str
    defs: dict[str, ast.stmt] = field(default_factory=dict)
    looplm_names: dict[str, tuple[str, str]] = field(default_factory=dict)  # alias → (mod, name)
    external: dict[str, ast.stmt] = field(default_factory=dict)  # alias → one-name import
    imported_modules: list[str] = field(default_factory=list)  # looplm modules, in import order
    scanned: list[str] = field(default_factory=list)  # submodules a package scan imports


def _external_key(node: ast.stmt) -> tuple:
    """What an external one-name import binds (two imports of one alias must agree)."""
    if isinstance(node, ast.Import):
        a = node.names[0]
        return ("module", a.name if a.asname else a.name.split(".")[0])
    return ("from", node.level, node.module, node.names[0].name)


class _Bundler:
    def __init__(self) -> None:
        self.modules: dict[str, _Module] = {}
        self.order: list[str] = []  # modules in the order the imports reach them

    # -- parsing ---------------------------------------------------------------------------
    def module(self, name: str) -> _Module:
        if name in self.modules:
            return self.modules[name]
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise LoopLMError(f"standalone export: cannot find the source of module {name!r}")
        path = Path(spec.origin)
        source = path.read_text(encoding="utf-8")
        mod = _Module(name, path, source)
        self.modules[name] = mod
        package = name if spec.submodule_search_locations is not None else name.rpartition(".")[0]
        for node in ast.parse(source).body:
            self._top_level(mod, node, package, spec)
        self.order.append(name)
        return mod

    def _top_level(self, mod: _Module, node: ast.stmt, package: str, spec) -> None:
        if isinstance(node, ast.Try) and all(
            isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body
        ):  # ``try: from looplm… import …`` (transformers skips imports inside try blocks)
            for n in node.body:
                self._import(mod, n, package)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self._import(mod, node, package)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self._define(mod, node.name, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and n.id != "__all__":
                        self._define(mod, n.id, node)
        elif (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == SCAN_CALL
        ):
            locations = list(spec.submodule_search_locations or [])
            mod.scanned = [
                f"{mod.name}.{m.name}"
                for m in sorted(pkgutil.iter_modules(locations), key=lambda m: m.name)
                if not m.name.startswith("_")
            ]
        # anything else at the top level (a docstring, a registration call) is not copied

    def _define(self, mod: _Module, name: str, node: ast.stmt) -> None:
        mod.defs[name] = node  # a name bound twice at the top level: the later statement

    def _import(self, mod: _Module, node: ast.stmt, package: str) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_looplm(a.name):
                    raise LoopLMError(
                        f"standalone export: {mod.name} imports the module {a.name!r}; "
                        "import names from it instead"
                    )
                alias = a.asname or a.name.split(".")[0]
                self._external(mod, alias, ast.Import(names=[a]))
            return
        assert isinstance(node, ast.ImportFrom)
        if node.module == "__future__":
            return
        target = node.module
        if node.level:
            target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
        if not _is_looplm(target) or (node.level and mod.name == ROOT_MODULE):
            # the root's relative imports name files of the export folder: kept as they are
            for a in node.names:
                one = ast.ImportFrom(module=node.module, names=[a], level=node.level)
                self._external(mod, a.asname or a.name, one)
            return
        if target not in mod.imported_modules:
            mod.imported_modules.append(target)
        for a in node.names:
            if a.asname and a.asname != a.name:
                raise LoopLMError(
                    f"standalone export: {mod.name} imports {a.name!r} as {a.asname!r}; "
                    "the bundle needs looplm names imported under their own names"
                )
            mod.looplm_names[a.name] = (target, a.name)

    def _external(self, mod: _Module, alias: str, node: ast.stmt) -> None:
        old = mod.external.get(alias)
        if old is not None and _external_key(old) != _external_key(node):
            if isinstance(node, ast.Import) and isinstance(old, ast.Import):
                pass  # ``import a`` and ``import a.b`` both bind ``a``
            else:
                raise LoopLMError(f"standalone export: {mod.name} binds {alias!r} twice")
        mod.external.setdefault(alias, node)

    # -- resolution ------------------------------------------------------------------------
    def resolve(self, module: str, name: str, seen: tuple = ()) -> tuple[str, str]:
        """The (module, name) whose top-level statement defines ``module.name``."""
        if (module, name) in seen:
            raise LoopLMError(f"standalone export: import cycle for {module}.{name}")
        mod = self.module(module)
        if name in mod.defs:
            return module, name
        if name in mod.looplm_names:
            return self.resolve(*mod.looplm_names[name], seen=(*seen, (module, name)))
        lazy = getattr(importlib.import_module(module), "__getattr__", None)
        table = getattr(lazy, "table", None)  # a light package face (lazy_attributes)
        if table and name in table:
            return self.resolve(table[name], name, seen=(*seen, (module, name)))
        if importlib.util.find_spec(f"{module}.{name}") is not None:
            raise LoopLMError(
                f"standalone export: {module}.{name} is a module; import names from it instead"
            )
        raise LoopLMError(f"standalone export: {module} defines no {name!r}")

    def references(self, module: str, node: ast.stmt) -> tuple[set, set, list[ast.stmt]]:
        """(looplm definitions, external aliases, function-level looplm imports) of ``node``."""
        mod = self.module(module)
        defs: set[tuple[str, str]] = set()
        external: set[str] = set()
        dropped: list[ast.stmt] = []
        package = module if mod.path.name == "__init__.py" else module.rpartition(".")[0]
        for n in ast.walk(node):
            if isinstance(n, ast.ImportFrom) and n is not node:
                target = n.module
                if n.level:
                    target = importlib.util.resolve_name("." * n.level + (n.module or ""), package)
                if _is_looplm(target):
                    for a in n.names:
                        if a.asname and a.asname != a.name:
                            raise LoopLMError(
                                f"standalone export: {module} imports {a.name!r} as {a.asname!r}"
                            )
                        defs.add(self.resolve(target, a.name))
                    dropped.append(n)
            elif isinstance(n, ast.Import) and any(_is_looplm(a.name) for a in n.names):
                raise LoopLMError(f"standalone export: {module} imports a looplm module by name")
            elif isinstance(n, ast.Name):
                if n.id in mod.defs:
                    defs.add((module, n.id))
                elif n.id in mod.looplm_names:
                    defs.add(self.resolve(*mod.looplm_names[n.id]))
                elif n.id in mod.external:
                    external.add(n.id)
        return defs, external, dropped

    def definition_time_names(self, module: str, node: ast.stmt) -> dict[tuple[str, str], bool]:
        """The looplm definitions ``node`` reads while it is being defined, each with whether it
        is called then (a decorator, a module-level call): function bodies and annotations are
        left out (they run later, or never with postponed annotations)."""
        mod = self.module(module)
        found: dict[tuple[str, str], bool] = {}

        def note(n: ast.AST, called: bool) -> None:
            if not isinstance(n, ast.Name):
                return
            if n.id in mod.defs:
                key = (module, n.id)
            elif n.id in mod.looplm_names:
                key = self.resolve(*mod.looplm_names[n.id])
            else:
                return
            found[key] = found.get(key, False) or called

        def visit(n: ast.AST) -> None:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for d in n.decorator_list:
                    note(d, True)
                    note(getattr(d, "func", None), True)
                    visit(d)
                if isinstance(n, ast.ClassDef):
                    for part in [*n.bases, *n.keywords, *n.body]:
                        visit(part)
                else:
                    defaults = [*n.args.defaults, *(x for x in n.args.kw_defaults if x)]
                    for d in defaults:
                        visit(d)
                return
            if isinstance(n, ast.Lambda):
                return
            if isinstance(n, ast.AnnAssign):
                if n.value is not None:
                    visit(n.value)
                return
            if isinstance(n, ast.Call):
                note(n.func, True)
            note(n, False)
            for child in ast.iter_child_nodes(n):
                visit(child)

        visit(node)
        return found


def _segment(mod: _Module, node: ast.stmt, dropped: list[ast.stmt]) -> str:
    """The source lines of ``node`` (decorators included) without the ``dropped`` imports; a
    block those imports leave empty gets ``pass``."""
    lines = mod.source.splitlines(keepends=True)
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    keep = {i: line for i, line in enumerate(lines[first - 1 : node.end_lineno], start=first)}
    parents = {c: p for p in ast.walk(node) for c in ast.iter_child_nodes(p)}
    for imp in dropped:
        body = next(
            getattr(parents[imp], f)
            for f in ("body", "orelse", "finalbody", "handlers")
            if imp in getattr(parents[imp], f, [])
        )
        for i in range(imp.lineno, imp.end_lineno + 1):
            keep.pop(i, None)
        if all(s in dropped for s in body):
            indent = lines[imp.lineno - 1][: imp.col_offset]
            keep[imp.lineno] = f"{indent}pass\n"
    return "".join(keep[i] for i in sorted(keep))


def standalone_source(version: str | None = None) -> str:
    """The text of a ``modeling_looplm.py`` that needs only torch and transformers."""
    if version is None:
        from looplm import __version__ as version
    b = _Bundler()
    included, external = _closure(b)
    statements, owner = _statements(b, included, external)
    module_order = _module_order(b)
    emitted = _order(b, statements, owner, included, module_order)
    modules = [m for m in module_order if any(statements[k]["module"] == m for k in emitted)]
    out = [_header(version, modules), "from __future__ import annotations\n\n"]
    imports = sorted({ast.unparse(s) for s in external.values()}, key=lambda s: (s[0] == "f", s))
    out.append("\n".join(imports) + "\n")
    current = None
    for k in emitted:
        e = statements[k]
        if e["module"] != current:
            current = e["module"]
            out.append(f"\n\n# {'-' * 20} {_relpath(b.modules[current].path)}\n")
        out.append("\n\n" + _segment(b.modules[current], e["node"], e["dropped"]))
    text = "".join(out)
    compile(text, "modeling_looplm.py", "exec")
    return text


Key = tuple[str, str]  # (module, top-level name)


def _closure(b: _Bundler) -> tuple[dict[Key, tuple[set, list]], dict[str, ast.stmt]]:
    """Every definition the root reaches: (module, name) → (its looplm references, its dropped
    function-level imports); and the external imports they use (alias → statement)."""
    pending: list[Key] = [(ROOT_MODULE, n) for n in b.module(ROOT_MODULE).defs]
    included: dict[Key, tuple[set, list]] = {}
    external: dict[str, ast.stmt] = {}
    while pending:
        key = pending.pop()
        if key in included:
            continue
        module, name = key
        mod = b.module(module)
        node = mod.defs[name]
        defs, ext, dropped = b.references(module, node)
        included[key] = (defs, dropped)
        for alias in ext:
            stmt = mod.external[alias]
            if alias in external and _external_key(external[alias]) != _external_key(stmt):
                raise LoopLMError(
                    f"standalone export: {alias!r} is imported differently in two modules"
                )
            external.setdefault(alias, stmt)
        pending.extend(defs)
        # every name a statement binds comes along with it (e.g. ``a = b = …``)
        pending.extend((module, n) for n, s in mod.defs.items() if s is node)
        # a package scan (the recurrence registry's) imports modules nothing names
        for scanning in [mod, *(b.module(m) for m in mod.imported_modules)]:
            for scanned in scanning.scanned:
                pending.extend((scanned, n) for n in b.module(scanned).defs)
    return included, external


def _statements(b: _Bundler, included: dict, external: dict) -> tuple[dict, dict]:
    """The statements to copy (one statement may bind several names) and which statement owns
    each global name; stops on two definitions of one name or a hidden builtin."""
    statements: dict[tuple[str, int], dict] = {}
    for (module, name), (_, dropped) in included.items():
        node = b.modules[module].defs[name]
        entry = statements.setdefault(
            (module, id(node)), {"module": module, "node": node, "names": set(), "dropped": []}
        )
        entry["names"].add(name)
        entry["dropped"] = dropped
    owner: dict[str, tuple[str, int]] = {}  # global name → statement key
    for key, entry in statements.items():
        for name in entry["names"]:
            if name in owner and owner[name] != key:
                other = statements[owner[name]]["module"]
                raise LoopLMError(
                    f"standalone export: {entry['module']} and {other} both define {name!r}"
                )
            owner[name] = key
    for alias in external:
        if alias in owner:
            raise LoopLMError(f"standalone export: {alias!r} is both an import and a definition")
    for entry in statements.values():  # a global must not hide a builtin another module uses
        mod = b.modules[entry["module"]]
        for n in ast.walk(entry["node"]):
            if not (isinstance(n, ast.Name) and hasattr(builtins, n.id) and n.id in owner):
                continue
            where = statements[owner[n.id]]["module"]
            if where != entry["module"] and n.id not in mod.defs:
                raise LoopLMError(
                    f"standalone export: {n.id!r} defined in {where} would hide the builtin "
                    f"{entry['module']} uses"
                )
    return statements, owner


def _module_order(b: _Bundler) -> list[str]:
    """Modules in the order Python runs them: each after those it imports at its top level."""
    order: list[str] = []

    def visit(m: str) -> None:
        if m in order or m not in b.modules:
            return
        order.append(m)  # placeholder against cycles; moved to the end below
        for dep in [*b.modules[m].imported_modules, *b.modules[m].scanned]:
            visit(dep)
        order.remove(m)
        order.append(m)

    for m in [ROOT_MODULE, *b.order]:
        visit(m)
    return order


def _order(b: _Bundler, statements: dict, owner: dict, included: dict, modules: list) -> list:
    """Statement keys in module order, source order inside; a statement moves up only for what
    it needs while being defined (and, for what it calls then, everything that call reaches)."""
    rank = {m: i for i, m in enumerate(modules)}
    keys = sorted(
        statements, key=lambda k: (rank[statements[k]["module"]], statements[k]["node"].lineno)
    )
    refs = {
        k: {owner[d[1]] for d in included[(e["module"], next(iter(e["names"])))][0]} - {k}
        for k, e in statements.items()
    }

    def closure(k: tuple) -> set:
        seen, todo = set(), [k]
        while todo:
            for d in refs[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    needs = {}
    for k in keys:
        e = statements[k]
        direct = {
            owner[n[1]]: called
            for n, called in b.definition_time_names(e["module"], e["node"]).items()
        }
        needs[k] = set(direct).union(*(closure(d) for d, c in direct.items() if c)) - {k}
    emitted: list[tuple] = []
    done: set = set()
    visiting: set = set()

    def emit(k: tuple) -> None:
        if k in done:
            return
        if k in visiting:
            raise LoopLMError(
                "standalone export: a definition-time dependency cycle at "
                f"{statements[k]['module']}.{sorted(statements[k]['names'])[0]}"
            )
        visiting.add(k)
        for d in sorted(needs[k], key=keys.index):
            emit(d)
        visiting.discard(k)
        done.add(k)
        emitted.append(k)

    for k in keys:
        emit(k)
    return emitted


def _relpath(path: Path) -> str:
    parts = path.parts
    i = len(parts) - 1 - parts[::-1].index(PACKAGE)
    return "/".join(parts[i:])


def _header(version: str, modules: list[str]) -> str:
    names = "\n".join(f"    {m}" for m in modules)
    return (
        '"""A looplm model for ``transformers`` that needs only torch and transformers.\n\n'
        f"Generated by ``looplm export --standalone`` (looplm {version}) from looplm's own source:\n"
        "the definitions below are copied from these modules, in an order that lets the file run\n"
        f"top to bottom:\n\n{names}\n\n"
        "Change the model in looplm and export again rather than editing this file.\n\n"
        "    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)\n"
        "    logits = model(input_ids, loops=12).logits\n"
        "    out = model.generate(input_ids, max_new_tokens=20, loops=12)\n"
        '"""\n\n'
    )
