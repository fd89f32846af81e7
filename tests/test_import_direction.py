"""Imports follow the README's arrows and form no cycle.

Every `.py` file of the installed packages is parsed with `ast`; every import counts,
including those inside functions (a function-level import only delays a cycle, it does
not remove it). The README's arrows: `models -> serving, rl` (models imports neither),
`sched -> runtime, sim` (sched imports neither) and everything -> `experiments` (nothing
outside experiments imports it). No two modules import each other, however indirectly,
and neither do two layers (packages, top-level modules, component configs). That sched
imports no jax is `tests/sched`'s business.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package prefix -> packages it must never import (the README's arrows, read backwards)
FORBIDDEN = {
    "tidejax.models": ("tidejax.serving", "tidejax.rl"),
    "tidejax.sched": ("tidejax.runtime", "tidejax.sim"),
}
EXPERIMENTS = "tidejax.experiments"


def _package_dirs() -> dict[str, pathlib.Path]:
    """Package name -> folder, from pyproject's package-dir (three live outside tidejax/)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setup["package-dir"].items()}


def _module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the installed packages."""
    dirs = _package_dirs()
    modules: dict[str, pathlib.Path] = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            # models/ is tidejax.models: a tidejax/models/ folder would claim it too
            assert name not in modules, f"{name}: both {modules[name]} and {path}"
            modules[name] = path
    return modules


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for each import in the file that names a known module.

    `from pkg import name` imports the submodule `pkg.name` when there is one, else
    `pkg` itself (its `__init__`). Parent packages that Python also runs first are not
    counted: otherwise every `__init__` that re-exports its submodules would close a loop
    with each submodule that imports a sibling, and that loop is how packages work.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(path) else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    return [(target, line) for target, line in found if target in known and target != name]


@functools.cache
def _graph() -> tuple[dict[str, pathlib.Path], dict[str, dict[str, int]]]:
    """Modules and their edges: importer -> {imported: first line}."""
    modules = _module_files()
    known = set(modules)
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        for target, line in _imports(name, path, known):
            edges[name].setdefault(target, line)
    return modules, edges


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _package(name: str) -> str:
    """The subpackage of tidejax a module is in, or the module itself if top-level."""
    return ".".join(name.split(".")[:2])


def _layer(name: str) -> str:
    """A package, a top-level module, or a component's `config` module.

    `tidejax.config` composes the components' configs (`rl.config`, `runtime.config`, ...)
    and runtime builds on `tidejax.config`: each component's config is a layer of its own,
    below `tidejax.config`, and not part of its package.
    """
    parts = name.split(".")
    return name if len(parts) == 3 and parts[2] == "config" else _package(name)


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _describe(component: list[str], edges: dict[str, dict[str, int]],
              where: dict[str, str]) -> str:
    inside = set(component)
    arrows = [f"    {a} -> {b} ({where.get(a, a)}:{line})"
              for a in component for b, line in sorted(edges[a].items()) if b in inside]
    return " <-> ".join(component) + "\n" + "\n".join(arrows)


def _against_arrows(edges: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for each import the README's arrows forbid."""
    bad = []
    for importer, targets in edges.items():
        for target, line in sorted(targets.items()):
            banned = [b for prefix, names in FORBIDDEN.items() if _within(importer, prefix)
                      for b in names]
            if any(_within(target, b) for b in banned) or (
                    _within(target, EXPERIMENTS) and not _within(importer, EXPERIMENTS)):
                bad.append((importer, target, line))
    return bad


def test_every_package_is_found():
    modules, edges = _graph()
    for package in _package_dirs():
        assert package in modules, f"{package} has no __init__.py under its package-dir"
    assert any(edges.values()), "no imports found at all"


def test_imports_follow_the_readme_arrows():
    modules, edges = _graph()
    bad = [f"{modules[a].relative_to(ROOT)}:{line}: {a} imports {b}"
           for a, b, line in _against_arrows(edges)]
    assert not bad, "imports against the README's direction:\n" + "\n".join(bad)


def test_no_module_import_cycle():
    modules, edges = _graph()
    where = {name: str(path.relative_to(ROOT)) for name, path in modules.items()}
    cycles = _cycles(edges)
    assert not cycles, "module import cycles:\n" + "\n".join(
        _describe(c, edges, where) for c in cycles)


def _layer_edges(edges: dict[str, dict[str, int]]) -> dict[str, dict[str, tuple[str, int]]]:
    """Layer -> {layer it imports: (first importing module, line)}."""
    layers: dict[str, dict[str, tuple[str, int]]] = {}
    for importer, targets in edges.items():
        a = _layer(importer)
        layers.setdefault(a, {})
        for target, line in sorted(targets.items()):
            b = _layer(target)
            layers.setdefault(b, {})
            if a == b or target == _package(importer) + ".config":
                continue  # inside one layer, or a package reading its own config
            layers[a].setdefault(b, (importer, line))
    return layers


def test_no_cycle_between_layers():
    """Collapsed to layers (`tidejax.runtime`, `tidejax.config`, `tidejax.rl.config`, ...),
    imports still point one way: a detour through another layer is a cycle all the same."""
    modules, edges = _graph()
    layers = _layer_edges(edges)
    cycles = _cycles(layers)
    lines = []
    for component in cycles:
        inside = set(component)
        lines.append(" <-> ".join(component))
        lines += [f"    {a} -> {b} (first at {modules[m].relative_to(ROOT)}:{line})"
                  for a in component for b, (m, line) in sorted(layers[a].items())
                  if b in inside]
    assert not cycles, "cycles between layers:\n" + "\n".join(lines)


# The checker itself, on small made-up graphs.
def test_arrow_check_flags_each_forbidden_direction():
    edges = {
        "tidejax.models.model": {"tidejax.serving.engine": 3, "tidejax.models.config": 4},
        "tidejax.sched.ctb": {"tidejax.runtime.manager": 5, "tidejax.sim": 6},
        "tidejax.runtime.job": {"tidejax.experiments.webshop": 7, "tidejax.sched.ctb": 8},
        "tidejax.experiments.simulate": {"tidejax.experiments": 9, "tidejax.sim": 10},
        "tidejax.rl.trainer": {"tidejax.models.model": 11},
    }
    assert sorted(_against_arrows(edges)) == [
        ("tidejax.models.model", "tidejax.serving.engine", 3),
        ("tidejax.runtime.job", "tidejax.experiments.webshop", 7),
        ("tidejax.sched.ctb", "tidejax.runtime.manager", 5),
        ("tidejax.sched.ctb", "tidejax.sim", 6),
    ]


def test_cycle_finder_sees_loops_and_nothing_else():
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]]
    two = _cycles({"a": {"b": 1}, "b": {"a": 1}, "c": {"d": 1}, "d": {"c": 1}})
    assert sorted(two) == [["a", "b"], ["c", "d"]]


def test_component_configs_are_layers_of_their_own():
    # tidejax.config taking a class from runtime's working code, which builds on it: a loop
    tangled = {"tidejax.config": {"tidejax.runtime.manager": 1},
               "tidejax.runtime.manager": {}, "tidejax.runtime.controller": {"tidejax.config": 2}}
    assert _cycles(_layer_edges(tangled)) == [["tidejax.config", "tidejax.runtime"]]
    # the same class in runtime's config module, which imports nothing of runtime: no loop;
    # nor is a package's own config importing the package (serving.config's kernel names)
    layered = {"tidejax.config": {"tidejax.runtime.config": 1, "tidejax.serving.config": 1},
               "tidejax.runtime.config": {}, "tidejax.runtime.controller": {"tidejax.config": 2},
               "tidejax.serving.config": {"tidejax.serving.paged_attention": 3},
               "tidejax.serving.paged_attention": {},
               "tidejax.serving.engine": {"tidejax.serving.config": 4}}
    assert _cycles(_layer_edges(layered)) == []
    # but a config that reaches back into its package's working code closes the loop again
    reaching = {**layered, "tidejax.runtime.config": {"tidejax.runtime.controller": 5}}
    assert _cycles(_layer_edges(reaching)) == [
        ["tidejax.config", "tidejax.runtime", "tidejax.runtime.config"]]


def test_from_import_of_a_submodule_is_an_edge_to_it(tmp_path):
    init = tmp_path / "pkg" / "__init__.py"
    sub = tmp_path / "pkg" / "sub.py"
    init.parent.mkdir()
    init.write_text("from pkg import sub\nfrom .other import thing\n")
    sub.write_text("def f():\n    from pkg import Name\n    import pkg.other\n")
    known = {"pkg", "pkg.sub", "pkg.other"}
    assert sorted(_imports("pkg", init, known)) == [("pkg.other", 2), ("pkg.sub", 1)]
    assert sorted(_imports("pkg.sub", sub, known)) == [("pkg", 2), ("pkg.other", 3)]
