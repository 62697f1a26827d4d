"""The package's layers, read from the source with ``ast`` (nothing is imported).

* ``ddiloco.core`` is the pure algorithm core every runtime drives: it imports none of the
  layers above it. One exception: :func:`ddiloco.core.codec._kernels` imports
  ``ddiloco.kernels`` lazily, inside the function, to resolve a codec's backend choice
  (that import reads ``DDILOCO_NO_JIT`` and loads numba, so it must never run at import).
* The core reads no environment variable and opens no file.
* Runtimes (``ddiloco.runtime.sim``, ``.processes``) never import each other: what they
  share lives in the core or in ``ddiloco.runtime`` itself. (Ray hosts the processes
  runtime's services: it lives in ``.processes.ray``.)
* ``ddiloco.cluster`` (the cluster simulator) never imports torch.
* No import cycle anywhere in the package: two modules that need each other's names share
  a third, or one reads the other through a ``Protocol`` it declares.

Every import counts: at module level, under ``if TYPE_CHECKING:``, inside functions,
relative ones, and ``importlib.import_module``/``__import__`` of a string literal.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "ddiloco"

CORE_MUST_NOT_IMPORT = (
    "ddiloco.runtime",
    "ddiloco.config",
    "ddiloco.commands",
    "ddiloco.methods",
    "ddiloco.strategies",
    "ddiloco.report",
    "ddiloco.cluster",
    "ddiloco.kernels",
)
LAZY_IN_CORE = ("ddiloco.kernels",)  # allowed inside a function body (see the docstring)
# sibling runtimes: none imports another. The Ray runtime is not one of them: it hosts the
# processes runtime's services in Ray actors (ddiloco.runtime.processes.ray, decision 76)
RUNTIMES = ("sim", "processes")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: Path
    line: int
    target: str  # the module imported (for ``from a import b``: also ``a.b``, see _targets)
    source: str  # the statement as written
    lazy: bool  # inside a function body


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _base(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module a (possibly relative) ``from`` import names."""
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (level - 1)]
    return ".".join([*package, name] if name else package)


def imports_of(source: str, module: str, path: Path, is_package: bool = False) -> list[Import]:
    """Every import in ``source``, each target on its own row."""
    out: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = _base(module, is_package, child.level, child.module)
                # ``from a import b`` may import the module a.b: both count
                targets = [base, *(f"{base}.{a.name}" for a in child.names if a.name != "*")]
            elif isinstance(child, ast.Call) and _dynamic_import(child) is not None:
                targets = [str(_dynamic_import(child))]
            if targets:
                text = (ast.get_source_segment(source, child) or "").strip()
                line = getattr(child, "lineno", 0)
                out.extend(Import(module, path, line, t, text, lazy) for t in targets)
            visit(child, inner)

    visit(ast.parse(source, str(path)), False)
    return out


def _dynamic_import(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in ("import_module", "__import__") and call.args:
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def _modules() -> list[tuple[str, Path, str]]:
    return [(module_name(p), p, p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


MODULES = _modules()
IMPORTS = [
    imp
    for name, path, text in MODULES
    for imp in imports_of(text, name, path, path.name == "__init__.py")
]


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _report(bad: list[Import], rule: str) -> str:
    rows = [f"  {i.module} ({i.path.relative_to(SRC.parent)}:{i.line}): {i.source}" for i in bad]
    return f"{rule}:\n" + "\n".join(dict.fromkeys(rows))


def test_the_core_imports_no_layer_above_it():
    bad = [
        i
        for i in IMPORTS
        if _under(i.module, "ddiloco.core")
        and any(_under(i.target, p) for p in CORE_MUST_NOT_IMPORT)
        and not (i.lazy and any(_under(i.target, p) for p in LAZY_IN_CORE))
    ]
    assert not bad, _report(bad, "ddiloco.core imports from a layer above it")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_runtimes_never_import_each_other(runtime):
    here = f"ddiloco.runtime.{runtime}"
    others = [f"ddiloco.runtime.{r}" for r in RUNTIMES if r != runtime]
    bad = [
        i for i in IMPORTS if _under(i.module, here) and any(_under(i.target, o) for o in others)
    ]
    assert not bad, _report(bad, f"{here} imports another runtime")


SHARED = ("checkpoints", "report", "methods", "data", "models", "chaos")


@pytest.mark.parametrize("package", SHARED)
def test_shared_packages_never_import_a_runtime(package):
    # what every runtime uses must not depend on one (runtime.run, the run's assembly, and
    # runtime.layout, where a run's files live, are shared themselves)
    here = f"ddiloco.{package}"
    runtimes = [f"ddiloco.runtime.{r}" for r in RUNTIMES]
    bad = [
        i for i in IMPORTS if _under(i.module, here) and any(_under(i.target, r) for r in runtimes)
    ]
    assert not bad, _report(bad, f"{here} imports a runtime")


def test_the_cluster_simulator_never_imports_torch():
    bad = [i for i in IMPORTS if _under(i.module, "ddiloco.cluster") and _under(i.target, "torch")]
    assert not bad, _report(bad, "ddiloco.cluster imports torch")


def _owner(target: str, names: set[str]) -> str | None:
    """The package module a target is (or is in): ``a.b.C`` -> ``a.b``."""
    while target and target not in names:
        target = target.rpartition(".")[0]
    return target or None


def import_cycles(imports: list[Import], names: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    graph: dict[str, set[str]] = {n: set() for n in names}
    for i in imports:
        owner = _owner(i.target, names)
        if owner is not None and owner != i.module:
            graph[i.module].add(owner)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def test_no_module_imports_itself_through_others():
    """Every import counts, under ``TYPE_CHECKING`` and inside functions too."""
    cycles = import_cycles(IMPORTS, {name for name, _, _ in MODULES})
    assert not cycles, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle_behind_type_checking():
    a = imports_of("import ddiloco.b\n", "ddiloco.a", Path("a.py"))
    b = imports_of(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddiloco.a import A\n",
        "ddiloco.b",
        Path("b.py"),
    )
    c = imports_of("def f():\n    from ddiloco import a\n", "ddiloco.c", Path("c.py"))
    names = {"ddiloco", "ddiloco.a", "ddiloco.b", "ddiloco.c"}
    assert import_cycles(a + b + c, names) == [["ddiloco.a", "ddiloco.b"]]
    lazy = imports_of("def f():\n    import ddiloco.c\n", "ddiloco.a", Path("a.py"))
    assert import_cycles(lazy + c, names) == [["ddiloco.a", "ddiloco.c"]]


THIRD_PARTY_PRIVATE = ("os._exit", "torch.autograd.Variable._execution_engine")


def private_uses(source: str, path: Path) -> list[str]:
    """``x._name`` read off anything but ``self``/``cls``, and ``from ddiloco... import
    _name``: a module reaching into another's privates."""
    out = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") or ast.unparse(node) in THIRD_PARTY_PRIVATE:
                continue
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddiloco"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
    return out


def test_no_module_reaches_into_anothers_private_names():
    bad = [use for _, path, text in MODULES for use in private_uses(text, path)]
    assert not bad, "private names used across files:\n  " + "\n  ".join(bad)


def test_the_syncer_state_is_the_only_door_to_the_round_policy():
    """Runtimes drive the syncer through ``SyncerState`` (join, leave, live, ...), never
    its round policy (issue 30): ``syncer.policy`` appears nowhere."""
    bad = [
        f"{path.name}:{node.lineno}: {ast.unparse(node)}"
        for _, path, text in MODULES
        for node in ast.walk(ast.parse(text, str(path)))
        if isinstance(node, ast.Attribute)
        and node.attr in ("policy", "_policy")
        and ast.unparse(node.value).endswith("syncer")
    ]
    assert not bad, "the round policy reached around SyncerState:\n  " + "\n  ".join(bad)
    found = private_uses("a._b\nself._c\nfrom ddiloco.x import _d\n", Path("t.py"))
    assert sorted(found) == ["t.py:1: a._b", "t.py:3: from ddiloco.x import _d"]


def io_uses(source: str, module: str, path: Path) -> list[Import]:
    """Reads of the environment and file openings: ``os.environ``, ``os.getenv``, ``environ``
    or ``getenv`` imported from os, ``open(...)`` (also ``io.open``, ``os.open``), ``Path(...)``."""
    out = []
    for node in ast.walk(ast.parse(source, str(path))):
        what = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr in ("environ", "getenv", "putenv", "open"):
                what = f"os.{node.attr}"
            elif node.value.id in ("io", "builtins", "pathlib") and node.attr in ("open", "Path"):
                what = f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            hits = [a.name for a in node.names if a.name in ("environ", "getenv", "open")]
            what = f"from os import {', '.join(hits)}" if hits else None
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("open", "Path", "PurePath")
        ):
            what = f"{node.func.id}(...)"
        if what is not None:
            line = getattr(node, "lineno", 0)
            out.append(Import(module, path, line, what, what, False))
    return out


def test_the_core_reads_no_environment_and_opens_no_file():
    bad = [
        use
        for name, path, text in MODULES
        if _under(name, "ddiloco.core")
        for use in io_uses(text, name, path)
    ]
    assert not bad, _report(bad, "ddiloco.core reads the environment or opens a file")


def test_the_checks_see_every_kind_of_import_and_io():
    """The checks above pass because the rules hold, not because they see nothing."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import ddiloco.config\n"
        "from .. import runtime\n"
        "from ..runtime.processes import wire\n"
        "if TYPE_CHECKING:\n"
        "    from ddiloco.report import summary\n"
        "def f():\n"
        "    import torch.nn\n"
        "    importlib.import_module('ddiloco.kernels.quantize_jit')\n"
        "    return os.environ.get('X'), open('f'), Path('p')\n"
    )
    path = PACKAGE / "core" / "example.py"
    found = {(i.target, i.lazy) for i in imports_of(source, "ddiloco.core.example", path)}
    assert {
        ("ddiloco.config", False),
        ("ddiloco.runtime", False),
        ("ddiloco.runtime.processes.wire", False),
        ("ddiloco.report.summary", False),
        ("torch.nn", True),
        ("ddiloco.kernels.quantize_jit", True),
    } <= found
    uses = {u.target for u in io_uses(source, "ddiloco.core.example", path)}
    assert uses == {"os.environ", "open(...)", "Path(...)"}
    assert len(MODULES) > 50 and any(_under(i.module, "ddiloco.core") for i in IMPORTS)
