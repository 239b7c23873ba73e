"""The layer rule of docs/architecture.md: modules import only downward, never in a circle.

Every ``import`` in ``carraystore/`` (``carraystore/migrations/`` included) counts, including the ones inside
functions: an import that runs late is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"carraystore": ROOT / "carraystore", "carraystore.migrations": ROOT / "migrations"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


@cache
def _parsed(text: str, filename: str) -> tuple[ast.Module, tuple[ast.Import | ast.ImportFrom, ...]]:
    """The syntax tree of a source text and every import statement in it (any depth), in
    ``ast.walk`` order. Keyed by the text itself, so an edited file is parsed again; the
    trees are shared between the tests, which only read them."""
    tree = ast.parse(text, filename)
    return tree, tuple(n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _tree(path: Path) -> ast.Module:
    return _parsed(path.read_text(), str(path))[0]


def _imports(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """Every ``import`` and ``from ... import`` statement of a file, inside functions too."""
    return _parsed(path.read_text(), str(path))[1]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to (a module, or the package that defines the name)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(path):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                if base not in modules:
                    continue  # a module not (yet) in this tree: no edge to its parent package
                # ``from pkg import submodule`` depends on the submodule, not on pkg's facade
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                r = _resolve(t, modules) if t.startswith("carraystore") else None
                if r is not None and r != mod:
                    graph[mod].add(r)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other (size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycles() -> None:
    cycles = strongly_connected(import_graph())
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_library_modules_never_import_the_facade() -> None:
    graph = import_graph()
    offenders = sorted(m for m, deps in graph.items() if "carraystore" in deps and m != "carraystore")
    assert not offenders, (
        f"these modules import the package facade `carraystore`; import the layer module instead: {offenders}"
    )


# The layers, lowest first (docs/architecture.md): one folder of the package per layer, so the
# folder list shows them. A module may import modules of its own layer or of lower ones, never
# of a higher one. The top-level modules are the facade's version, the adapters and nothing else.
LAYERS: list[tuple[str, set[str]]] = [
    ("0 base", {"carraystore.base", "carraystore._version"}),
    ("1 format", {"carraystore.format"}),
    ("2 byte sources", {"carraystore.sources"}),
    ("3 store: reader and writer", {"carraystore.store"}),
    ("4 engine", {"carraystore.engine"}),
    # library tools that make stores: ingest from folders, migrations from other formats (through the writer)
    ("5 ingest and migrations", {"carraystore.ingest", "carraystore.migrations"}),
    # the user's Store: the reader plus the loaders as methods (batches, to_dask)
    ("6 api", {"carraystore.api"}),
    # the adapters: one framework each; ingest never imports them (the facade and the CLI pick the dask path)
    (
        "7 adapters",
        {"carraystore.keras", "carraystore.tf", "carraystore.dask", "carraystore.torch", "carraystore.grain"},
    ),
    # the command line (and `carraystore bench`), on top of everything above
    ("8 CLI", {"carraystore.cli"}),
]
LAYER_NAMES = [name for name, _ in LAYERS]


def _layer(mod: str) -> int:
    """The layer of ``mod``: the one its folder (package) or, for a top-level module, its name is placed in."""
    for i, (_, names) in enumerate(LAYERS):
        if any(mod == n or mod.startswith(n + ".") for n in names):
            return i
    return len(LAYERS)  # the facade, and a module nobody placed (test_every_module_has_a_layer)


def test_every_module_has_a_layer() -> None:
    """Every module of the package sits in a layer's folder (or is a placed top-level module);
    only the facade ``carraystore`` stands on top of everything."""
    unplaced = sorted(m for m in import_graph() if m != "carraystore" and _layer(m) == len(LAYERS))
    assert not unplaced, (
        f"modules outside the layer folders (tests/project/test_architecture.py, docs/architecture.md): {unplaced}"
    )
    assert _layer("carraystore.migrations.core") == _layer("carraystore.ingest.run")


def test_every_layer_folder_is_in_the_wheel() -> None:
    """pyproject's package list names every folder of the package, the top-level migrations/ included."""
    tomllib = pytest.importorskip("tomllib")

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    folders = {m for m, path in _modules().items() if path.name == "__init__.py"}
    assert folders == listed, (sorted(folders - listed), sorted(listed - folders))
    assert conf["package-dir"]["carraystore.migrations"] == "migrations"


def test_layers_import_only_downward() -> None:
    graph = import_graph()
    upward = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer(m) < len(LAYERS) and _layer(d) > _layer(m)
    )
    assert not upward, f"lower layers importing higher ones: {upward}"


def test_ingest_never_imports_the_adapters() -> None:
    # the cluster ingest lives in the dask adapter, which passes ingest a runner: no upward import
    graph = import_graph()
    ingest = {m for m in graph if m.startswith("carraystore.ingest")}
    assert all(not (graph[m] & (set(ADAPTERS) | {"carraystore.dask"})) for m in ingest)
    assert _layer("carraystore.ingest.run") < _layer("carraystore.dask") < _layer("carraystore.cli.commands")


def test_the_checker_sees_cycles_and_function_level_imports(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    # an import inside a function is found
    src = "def f():\n    from carraystore.engine.loader import batches\n"
    tree = ast.parse(src)
    found = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert found == ["carraystore.engine.loader"]


def test_atomic_files_need_only_the_errors() -> None:
    """``atomic`` (temporary names, fsync-and-rename, named write errors) sits below everything that writes a file."""
    deps = import_graph()["carraystore.base.atomic"]
    assert deps <= {"carraystore.base.errors"}, (
        f"carraystore.base.atomic imports {sorted(deps)}; it may import only errors"
    )


# The adapters: a framework's module beside the engine, imported by nothing in the package
# (users import them), and the only module that imports its framework (the benchmarks aside:
# they run the frameworks' own loaders as peers).
ADAPTERS: dict[str, tuple[str, ...]] = {
    "carraystore.keras": ("keras",),
    "carraystore.tf": ("tensorflow",),
    "carraystore.torch": ("torch",),
    "carraystore.grain": ("grain",),
}


def _external_imports(path: Path) -> set[str]:
    """Top-level names of the packages a file imports (any depth, relative imports aside)."""
    out: set[str] = set()
    for node in _imports(path):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.slow
def test_adapters_are_imported_by_no_other_module_and_alone_import_their_framework() -> None:
    graph = import_graph()
    modules = _modules()
    assert set(ADAPTERS) <= set(modules), sorted(set(ADAPTERS) - set(modules))
    importers = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if d in ADAPTERS)
    assert not importers, f"modules importing an adapter (only users should): {importers}"
    for adapter, frameworks in ADAPTERS.items():
        for mod, path in modules.items():
            if mod == adapter or mod.startswith("carraystore.cli.benchmarks."):
                continue
            found = _external_imports(path) & set(frameworks)
            assert not found, f"{mod} imports {sorted(found)}, which only {adapter} may import"


# -- the package boundary: benchmark and test code stays out of the library ----------------------

#: What a library module may never import: the benchmarks (the `carraystore bench` command and
#: the helpers of bench/), and the test and benchmark infrastructure outside the wheel.
NOT_FOR_THE_LIBRARY = ("carraystore.cli.benchmarks", "testsupport", "tests", "bench", "remote_servers", "conftest")


def imported_names(path: Path, mod: str) -> set[str]:
    """Every module name ``path`` (module ``mod``) imports, anywhere in it, relative ones made absolute."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in _imports(path):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod if is_pkg else mod.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _forbidden(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in NOT_FOR_THE_LIBRARY))


def test_library_modules_never_import_benchmark_or_test_code() -> None:
    offenders = {}
    for mod, path in _modules().items():
        if mod == "carraystore.cli.benchmarks" or mod.startswith("carraystore.cli.benchmarks."):
            continue
        bad = _forbidden(imported_names(path, mod))
        if bad:
            offenders[mod] = bad
    assert not offenders, f"library modules that import benchmark or test code: {offenders}"


def test_the_wheel_holds_no_test_support_code() -> None:
    """The test infrastructure lives in testsupport/ at the top of the repository, outside the
    wheel; the benchmarks shipped in the wheel import it only inside a function (the PyTorch
    peers of bench/bench_remote.py), never when `carraystore bench` loads them."""
    assert not (ROOT / "carraystore" / "cli" / "benchmarks" / "servers.py").exists()
    assert (ROOT / "testsupport" / "servers.py").is_file() and (ROOT / "testsupport" / "netproxy.py").is_file()
    for mod, path in _modules().items():
        top = _tree(path).body
        names: set[str] = set()
        for node in top:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= imported_names_of(node)
        assert not [n for n in names if n.split(".")[0] in ("testsupport", "tests", "bench")], (mod, names)


def imported_names_of(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    return {node.module or ""}


def test_the_boundary_checker_sees_relative_and_late_imports(tmp_path: Path) -> None:
    f = tmp_path / "reader.py"
    f.write_text("def f():\n    from .benchmarks import remote\n    import testsupport.servers\n")
    names = imported_names(f, "carraystore.cli.reader")
    assert _forbidden(names) == [
        "carraystore.cli.benchmarks",
        "carraystore.cli.benchmarks.remote",
        "testsupport.servers",
    ]
    f.write_text("from carraystore.benchmarks_x import y\nimport benchmark\n")
    assert _forbidden(imported_names(f, "carraystore.store.reader")) == []
