"""The package's imports, read with ``ast`` (nothing is imported):

- the import graph of ``jax_cpgrad`` has no cycle (imports inside functions count too: a cycle
  broken only by a lazy import is still one layer knowing the one above it);
- no module of the package uses another module's underscore names (``module._name``,
  ``from .module import _name``); private modules (``_native.py``) may be imported, their public
  names used;
- ``benchmarks/`` and ``experiments/`` (and the examples) use only the package's public names: no
  private module, no underscore name of a module, no private member of the package's classes
  (``ws._native``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "jax_cpgrad"
USERS = ("benchmarks", "experiments", "examples")  # code outside the package, held to its public names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of every Python module of the package (a compiled module by its
    ``.pyi`` stub)."""
    out = {}
    for path in sorted([*(root / PACKAGE).rglob("*.py"), *(root / PACKAGE).rglob("*.pyi")]):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    """The absolute module name of ``from <node.module> import ...`` written in ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module, modules):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class Use:
    """One use of the package in a file: where, and what (dotted)."""

    def __init__(self, path: Path, line: int, what: str):
        self.path, self.line, self.what = path, line, what

    def __repr__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.what}"


def imports_of(module: str | None, path: Path, modules: dict[str, Path]) -> tuple[list[Use], list[Use]]:
    """(modules of the package imported, uses of underscore names of the package) in one file.
    ``module``: the file's own dotted name, None outside the package."""
    tree = ast.parse(path.read_text())
    imported: list[Use] = []
    private: list[Use] = []
    aliases: dict[str, str] = {}  # local name -> package module it is bound to

    def note(line: int, target: str, name: str | None = None) -> None:
        """An import of module ``target`` (of its ``name``): private where it names an underscore
        name other than the file's own; inside the package, private modules are fine."""
        imported.append(Use(path, line, target))
        dotted = target if name is None else f"{target}.{name}"
        if module is None:
            if any(_private(p) for p in dotted.split(".")):
                private.append(Use(path, line, dotted))
        elif name is not None and _private(name) and target != module:
            private.append(Use(path, line, dotted))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    note(node.lineno, a.name)
                    aliases[a.asname or PACKAGE] = a.name if a.asname else PACKAGE
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module or "", node, modules) if node.level else (node.module or "")
            if source.split(".")[0] != PACKAGE:
                continue
            for a in node.names:
                full = f"{source}.{a.name}"
                if full in modules:  # a submodule
                    note(node.lineno, full)
                    aliases[a.asname or a.name] = full
                else:  # a name of the module `source`
                    note(node.lineno, source, a.name)
    for node in ast.walk(tree):  # alias._name, alias.sub._name
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                dotted = ".".join([aliases[inner.id], *reversed(chain)])
                names = dotted.split(".")
                if any(_private(p) for p in names) and dotted.rsplit(".", 1)[0] != module:
                    # `_native.HAS_CUDA` inside the package: a private module is fine there.
                    inside = module is not None
                    if not inside or _private(names[-1]) or _private_outside_module(names, modules):
                        private.append(Use(path, node.lineno, dotted))
    return imported, private


def _private_outside_module(names: list[str], modules: dict[str, Path]) -> bool:
    """An underscore name reached through a module (``mod._x.y``) rather than a private module."""
    for i in range(1, len(names) + 1):
        if _private(names[i - 1]) and ".".join(names[:i]) not in modules:
            return True
    return False


def private_members(modules: dict[str, Path]) -> set[str]:
    """Underscore attributes and methods of the package's public classes (``Workspace._native``)."""
    found = set()
    for module, path in modules.items():
        if any(_private(p) for p in module.split(".")):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not _private(node.name):
                for sub in node.body:  # class attributes (an alias: `_old = new`)
                    if isinstance(sub, ast.Assign):
                        found |= {t.id for t in sub.targets if isinstance(t, ast.Name) and _private(t.id)}
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(sub.name):
                        found.add(sub.name)
                    elif (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                        and _private(sub.attr)
                    ):
                        found.add(sub.attr)
    return found


def member_uses(path: Path, members: set[str]) -> list[Use]:
    """``x._member`` (x not self or cls) for the package classes' private members."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in members:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(Use(path, node.lineno, f"._{node.attr.lstrip('_')} (a private member)"))
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        imported, _ = imports_of(module, path, modules)
        graph[module] = {u.what for u in imported if u.what in modules and u.what != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph(package_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_of_the_package_uses_another_modules_underscore_names():
    modules = package_modules()
    offenders = [use for m, p in modules.items() for use in imports_of(m, p, modules)[1]]
    # Private members of the package's classes, outside the module that defines them.
    for module, path in modules.items():
        own = private_members({module: path})
        offenders += member_uses(path, private_members(modules) - own)
    assert not offenders, "underscore names used across modules:\n" + "\n".join(map(repr, offenders))


def test_benchmarks_experiments_and_examples_use_only_public_names():
    modules = package_modules()
    members = private_members(modules)
    offenders = []
    for folder in USERS:
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []:
            offenders += imports_of(None, path, modules)[1] + member_uses(path, members)
    assert not offenders, "private names of jax_cpgrad used outside it:\n" + "\n".join(map(repr, offenders))


# -- the checks fail on planted offenders ----------------------------------------------------------


def test_a_planted_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_planted_private_uses_are_found(tmp_path):
    modules = package_modules()
    user = tmp_path / "bench.py"
    user.write_text(
        "import jax_cpgrad as cpg\n"
        "from jax_cpgrad._native import bench_ext\n"
        "from jax_cpgrad.api import _prepare\n"
        "from jax_cpgrad import workspace\n"
        "x = cpg.api._as_tuple\n"
        "y = workspace._default_timeout()\n"
        "z = ws._native\n"
        "ok = cpg.grad_return, workspace.Workspace, self._native\n"
    )
    found = [u.what for u in imports_of(None, user, modules)[1]]
    found += [u.what for u in member_uses(user, private_members(modules))]
    assert found == [
        "jax_cpgrad._native.bench_ext",
        "jax_cpgrad.api._prepare",
        "jax_cpgrad.api._as_tuple",
        "jax_cpgrad.workspace._default_timeout",
        "._native (a private member)",
    ], found
