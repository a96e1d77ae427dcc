"""Imports run one way (issue #57, the floor plan): no file imports itself back through others,
and no module takes another's private (``_name``) names.

An ast reading of every ``.py`` file under pipelines/, udfs/ and serve/, nothing imported: its
module-level and function-level imports make a graph of files, in which a cycle is a failure,
and ``from X import _name`` from another module is a failure too (a name used across modules
is public: it goes without the underscore). ``serve/`` runs a batch through
``pipelines.batchfile.run.run_batch`` and the CLI sits on top of everything, so there is no cycle to
allow.

How an import becomes an edge (from the importing file to the file it runs):

- ``import a.b.c`` and ``from a.b import c`` where ``a/b/c.py`` (or ``a/b/c/__init__.py``) is
  a module: to that module's file; relative imports are resolved against the file's package;
- ``from a.b import name`` of a name that is not a module: to ``a/b.py``, or to
  ``a/b/__init__.py``, the package's face, even where the face only re-exports the name from
  a submodule: that import runs the face, and the face runs its submodules, so a submodule
  that imports its own package's face (``from a.b import name``, ``import a.b``) while the
  face imports it is a cycle (the name may not be bound yet when it runs);
- the ``__init__.py`` files of an imported module's parent packages, which Python runs first,
  are not edges: a submodule's parents are always imported before it runs, and as edges they
  would make every import of a sibling (``from a.b.sib import name``) a false cycle through
  the face;
- imports of anything outside the three packages are not edges.

A private name is one that starts with one underscore (``__all__``, ``__version__`` are not);
``from pkg import _name`` in a submodule of ``pkg`` is another module's too (the package's
``__init__.py``), and so is ``module._name`` of a module the file imported (``import a.b`` or
``from a import b``, then ``a.b._name`` or ``b._name``). ``import x as _x`` and ``from x import
name as _name`` (a public name kept under a private alias) are fine.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "udfs", "serve")


class Imports:
    """The import graph of the packages ``packages`` under ``root``."""

    def __init__(self, root: Path, packages=PACKAGES):
        self.root = root
        self.files: dict[str, Path] = {}  # dotted module name -> its file
        self.is_package: dict[str, bool] = {}
        for package in packages:
            for path in sorted((root / package).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                package_face = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if package_face else parts)
                self.files[name], self.is_package[name] = path, package_face
        self.trees = {name: ast.parse(path.read_text(encoding="utf-8"), str(path))
                      for name, path in self.files.items()}
        self.edges: dict[str, set[str]] = {name: set() for name in self.files}
        self.private: list[str] = []  # "file:line: from X import _name"
        for name in self.files:
            self._read(name)
        self.private.sort(key=lambda found: (found.split(":")[0], int(found.split(":")[1])))

    def rel(self, module: str) -> str:
        return self.files[module].relative_to(self.root).as_posix()

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module.split(".") if self.is_package[module] else module.split(".")[:-1]
        base = package[:len(package) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def _read(self, module: str) -> None:
        modules = {}  # a name the file binds to one of the packages' modules -> that module
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.files:
                        self.edges[module].add(alias.name)
                    top = alias.name.split(".")[0]
                    if alias.asname and alias.name in self.files:
                        modules[alias.asname] = alias.name
                    elif not alias.asname and top in self.files:
                        modules[top] = top
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node)
                for alias in node.names:
                    if f"{source}.{alias.name}" in self.files:  # a module of the package
                        self.edges[module].add(f"{source}.{alias.name}")
                        modules[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif source in self.files:
                        self.edges[module].add(source)
                        if _private(alias.name) and source != module:
                            self.private.append(f"{self.rel(module)}:{node.lineno}: from "
                                                f"{source} import {alias.name}")
        self.edges[module].discard(module)
        for node in ast.walk(self.trees[module]):  # module._name, of a module imported
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = _dotted(node.value, modules)
                if owner in self.files and owner != module:
                    self.private.append(f"{self.rel(module)}:{node.lineno}: {owner}.{node.attr}")

    def cycles(self) -> list[tuple[list[str], list[str]]]:
        """Each set of files that import each other (a strongly connected set of more than
        one), as one cycle through it (its files, the first again at the end) and the set's
        files, by file path."""
        found = []
        for component in _components(self.edges):
            if len(component) > 1:
                found.append(([self.rel(m) for m in _cycle_in(self.edges, component)],
                              sorted(self.rel(m) for m in component)))
        return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr, modules: dict[str, str]) -> str | None:
    """The module a ``name.name...`` expression names, through the names the file bound to
    modules (``import a.b`` binds ``a``: ``a.b`` is then module ``a.b``)."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value, modules)
        return owner and f"{owner}.{node.attr}"
    return None


def _components(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    found.append(component)
    return found


def _cycle_in(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """One cycle through the component's first module (a shortest one back to it)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & component):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in {sorted(component)}")  # pragma: no cover


def _report(imports: Imports) -> tuple[list[str], list[str]]:
    cycles = [" -> ".join(cycle) + (f"  (through a set of {len(files)} files that import each "
                                    f"other: {', '.join(files)})"
                                    if len(files) > len(cycle) - 1 else "")
              for cycle, files in imports.cycles()]
    return cycles, imports.private


# -- the project ------------------------------------------------------------------------------

@functools.cache
def project() -> Imports:
    return Imports(REPO)


def test_no_file_imports_itself_back():
    cycles, _ = _report(project())
    assert not cycles, "import cycles (each: files, the first again at the end):\n" + \
        "\n".join(cycles)


def test_no_module_imports_another_modules_private_names():
    _, private = _report(project())
    assert not private, "private names imported from another module (make them public, or " \
        "move them where they are used):\n" + "\n".join(private)


def test_the_checker_reads_every_file_and_its_function_level_imports():
    found = project()
    assert len(found.files) > 60
    assert "pipelines.batchfile.run" in found.edges["serve.worker"]  # a function-level import
    assert "serve.server" in found.edges["pipelines.cli"]
    # `from pipelines.report import view`: a module of the package, not the package's face
    assert "pipelines.report.view" in found.edges["serve.routes_view"]
    assert "pipelines" not in found.edges["serve.routes_view"]


# -- the checker, on a package made to fail ----------------------------------------------------

def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_finds_a_cycle_and_a_private_import(tmp_path):
    _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def run():\n    from .sub import c\n    return c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.b\n",
        "pkg/b.py": "from pkg.a import run\n_SECRET = 1\n",
        "pkg/d.py": "from pkg.b import _SECRET, __doc__\nfrom pkg.a import run as _run\n",
        "pkg/e.py": "def f():\n    from . import _helper\n",  # the face: another module
        "other/__init__.py": "",
        "other/f.py": "import pkg.d\nfrom pkg.sub import c\nfrom os import _exit\n"
                      "from pkg import b as bee\n\n\ndef g():\n"
                      "    return pkg.d._x, bee._SECRET, c.public, pkg.d.__name__\n",
    })
    found = Imports(tmp_path, ("pkg", "other"))
    cycles, private = _report(found)
    assert cycles == ["pkg/a.py -> pkg/sub/c.py -> pkg/b.py -> pkg/a.py"]
    assert private == ["other/f.py:8: pkg.d._x", "other/f.py:8: pkg.b._SECRET",
                       "pkg/d.py:1: from pkg.b import _SECRET",
                       "pkg/e.py:2: from pkg import _helper"]
    assert found.edges["other.f"] == {"pkg.b", "pkg.d", "pkg.sub.c"}
    assert found.edges["pkg.e"] == {"pkg"}


def test_a_cycle_is_reported_with_every_file_of_its_set(tmp_path):
    _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import pkg.b\nimport pkg.c\n",
        "pkg/b.py": "import pkg.a\n",
        "pkg/c.py": "import pkg.d\n",
        "pkg/d.py": "import pkg.a\n",
    })
    assert _report(Imports(tmp_path, ("pkg",)))[0] == [
        "pkg/a.py -> pkg/b.py -> pkg/a.py  (through a set of 4 files that import each other: "
        "pkg/a.py, pkg/b.py, pkg/c.py, pkg/d.py)"]


def test_a_submodule_importing_its_packages_face_back_is_a_cycle(tmp_path):
    _package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
        "pkg/a.py": "A = 1\n",
        "pkg/b.py": "from pkg.a import A\nB = A\n",  # a sibling's name, from the sibling
        "other/__init__.py": "",
        "other/c.py": "from pkg import A\nimport pkg.a\n",  # the face; pkg.a (not its parent)
    })
    found = Imports(tmp_path, ("pkg", "other"))
    assert _report(found) == ([], [])
    assert found.edges["pkg.b"] == {"pkg.a"} and found.edges["other.c"] == {"pkg", "pkg.a"}
    _package(tmp_path, {"pkg/b.py": "from pkg import A\nB = A\n"})  # through the face
    assert _report(Imports(tmp_path, ("pkg", "other")))[0] == [
        "pkg/__init__.py -> pkg/b.py -> pkg/__init__.py"]
