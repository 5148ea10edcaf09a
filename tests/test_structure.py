"""The layout of the code stays livable: rooms of bounded size, no import cycle, tests
independent of the benchmarks, and no reach into private attributes from the outside.

Read from the source with ``ast`` (nothing is imported), so a violation names the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("horovod_micro", "horovod_micro_train")
MAX_CLASS_LINES = 250
#: The optimizer module holds Horovod's contract only (one class, whose parts are objects
#: of their own modules: the hooks, the dense and sparse paths, the elastic binding) and
#: the factory that builds it.
MAX_OPTIMIZER_LINES = 410


def _modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in it (a lazy
    import inside a function closes a cycle as surely as one at the top)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # the module itself, or the nearest enclosing module that exists
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _is_package_init(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    """Between modules; a package's ``__init__`` that re-exports its submodules is not a
    room of its own (importing ``pkg.sub`` runs it first, whatever imports what)."""
    modules = _modules(package)
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        if _is_package_init(name, modules):
            continue
        graph[name] = {m for m in _imports(name, path, known)
                       if not _is_package_init(m, modules)}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_class_is_over_the_size_of_one_room(package):
    big = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                               f"({lines} lines)")
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


def test_the_optimizer_module_holds_the_contract_only():
    lines = len((ROOT / "horovod_micro" / "optimizer.py").read_text().splitlines())
    assert lines <= MAX_OPTIMIZER_LINES, f"optimizer.py has {lines} lines"


def test_tests_do_not_import_the_benchmarks():
    """Test infrastructure lives in ``tests/``, ``hvm_testbed`` or
    ``horovod_micro.testing``; only the tests of a benchmark import it."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name == "bench" or name.startswith("bench."):
                    bench = name.split(".")[1] if "." in name else ""
                    if not bench or path.stem != f"test_{bench}":
                        offenders.append(f"{path.name}: {name}")
    assert not offenders, offenders


#: Private names of other libraries that tests reach on purpose: ``os._exit`` (a rank that
#: dies without cleanup), ``torch._dynamo`` (the tracing checks), a tensor's ``_base`` (a
#: view's storage) and Horovod's own optimizer's ``_parameter_names`` (the compatibility
#: tests compare with it).
FOREIGN_PRIVATE = {"_exit", "_dynamo", "_base", "_parameter_names"}


@pytest.mark.parametrize("folder", ["bench", "horovod_micro_train", "jobs", "train", "tests",
                                    "gpu_tests", "hvm_testbed"])
def test_no_reach_into_the_librarys_private_attributes(folder):
    """What uses the library (benchmarks, the entrypoints, the job scripts, the tests) goes
    through its public names: no ``obj._name`` attribute access and no ``getattr(obj,
    "_name")`` on library objects. A module's own private helpers (``_name`` defined in that
    module) stay allowed, and so do the few private names of other libraries listed in
    :data:`FOREIGN_PRIVATE`."""
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = {n.name for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)}
        own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}
        own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
                and isinstance(n.ctx, ast.Store)}
        allowed = own | FOREIGN_PRIVATE
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in allowed):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                    and node.args[1].value.startswith("_")
                    and not node.args[1].value.startswith("__")
                    and node.args[1].value not in allowed):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                                 f"{node.func.id}(..., {node.args[1].value!r})")
    assert not offenders, offenders


def test_the_front_pages_and_the_results_stay_readable():
    """The README fits a first read (150 lines), BENCHMARKS.md a full one (400), and
    ``bench/results/`` holds at most 25 files: new measurements join an existing file or
    replace one."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 400
    results = [p for p in (ROOT / "bench" / "results").rglob("*") if p.is_file()]
    assert len(results) <= 25, sorted(p.name for p in results)


def _self_stores_and_private_defs(tree: ast.AST) -> set[str]:
    """Private names a module defines on its objects: ``self._x = ...`` and methods
    ``def _x`` of its classes."""
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == "self"
             and isinstance(n.ctx, ast.Store) and n.attr.startswith("_")
             and not n.attr.startswith("__")}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        names |= {f.name for f in cls.body
                  if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                  and f.name.startswith("_") and not f.name.startswith("__")}
    return names


def test_no_private_name_of_the_optimizer_crosses_modules():
    """A private attribute or method of the optimizer (set or defined in ``optimizer.py``)
    is used in ``optimizer.py`` alone: its parts are objects with public interfaces, not
    methods merged into its class that share its private fields."""
    library = ROOT / "horovod_micro"
    own = _self_stores_and_private_defs(ast.parse((library / "optimizer.py").read_text()))
    offenders = []
    for path in sorted(library.rglob("*.py")):
        if path.name == "optimizer.py":
            continue
        tree = ast.parse(path.read_text())
        theirs = _self_stores_and_private_defs(tree)
        offenders += [f"{path.relative_to(ROOT)}:{n.lineno} .{n.attr}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and n.attr in own - theirs]
    assert own and not offenders, offenders


def test_select_leaves_nothing_for_combine_or_observe():
    """No compressor sets an attribute of its own in ``select`` that its ``combine`` or
    ``observe`` reads: a step's data travels in the ``Selection`` and the ``Aggregate``."""
    offenders = []
    for path in sorted((ROOT / "horovod_micro" / "compressors").rglob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.ClassDef)):
            methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}

            def self_attrs(name, ctx, methods=methods):
                return {n.attr for n in ast.walk(methods[name]) if isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name) and n.value.id == "self"
                        and isinstance(n.ctx, ctx)} if name in methods else set()
            stored = set().union(*(self_attrs(m, ast.Store) for m in methods
                                   if m == "select" or m.startswith("_select")))
            read = self_attrs("combine", ast.Load) | self_attrs("observe", ast.Load)
            offenders += [f"{path.relative_to(ROOT)} {cls.name}.{a}" for a in stored & read]
    assert not offenders, offenders
