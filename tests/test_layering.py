"""Imports flow one way: study -> verdicts -> doctor -> record -> analysis -> train -> rundir -> objectives ->
data | nn -> config -> registry -> errors, and no two modules import each other, directly or around a loop.

Every ``import`` statement in the package, at module level or inside a function, is read with ``ast``; an
import of a higher layer (or of a sibling of the same layer) fails this test unless ``EXCEPTIONS`` lists it
with its reason, and so does any cycle in the graph of those imports, within a package too. The CLI modules
(``kilolayer/cli.py``, ``__main__.py`` and each package's ``cli.py``) sit at the edge: they may import
anything, and nothing but another CLI module may import them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kilolayer

PACKAGE = Path(kilolayer.__file__).parent

# lowest first; the units of one layer are siblings and may not import each other
LAYERS: list[set[str]] = [
    {"errors", "files"},  # files: atomic writes
    {"registry", "presets"},  # presets: plain data
    {"config"},
    {"nn", "data"},
    {"objectives"},
    {"kilolayer"},  # the package's own __init__: re-exports config and nn, loads the plugins that fill the registries
    {"rundir"},  # the run-directory format: train writes it, everything above reads it
    {"train"},
    {"analysis"},
    {"record"},  # the one run record every reader uses: status, evaluations, chance, learned, analyses
    {"doctor"},  # diagnoses runs with analysis; a study's report quotes its diagnoses
    {"verdicts"},  # the rule, measures, contrasts and claims: read runs, decide
    {"study"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

# (importer, imported, reason): an edge upward that is there on purpose, if one ever is. Prefixes match submodules.
EXCEPTIONS: list[tuple[str, str, str]] = [
    ("kilolayer", "kilolayer.train.trained", "kilolayer.load, a trained model's public face, imported when called"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(importer: Path, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The kilolayer modules an import statement loads (``from pkg import sub`` is the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "kilolayer"]
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        pkg = module_name(importer).split(".")
        if importer.name != "__init__.py":
            pkg = pkg[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "kilolayer":
        return []
    folder = PACKAGE.parent.joinpath(*base.split("."))
    out = []
    for a in node.names:
        sub = folder / a.name
        out.append(f"{base}.{a.name}" if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file() else base)
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kilolayer"


def is_cli(module: str) -> bool:
    return module.split(".")[-1] in ("cli", "__main__")


def edges() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [(module_name(path), target, node.lineno) for target in resolve(path, node)]
    return found


def excused(importer: str, imported: str) -> bool:
    return any(importer == a and (imported == b or imported.startswith(b + ".")) for a, b, _ in EXCEPTIONS)


def upward(importer: str, imported: str) -> bool:
    if is_cli(importer):
        return False  # the edge: a command imports what it runs
    if is_cli(imported):
        return True
    a, b = unit(importer), unit(imported)
    return a != b and RANK[b] >= RANK[a]


def test_every_unit_has_a_layer():
    units = {unit(m) for m, _, _ in edges()} | {unit(t) for _, t, _ in edges()}
    assert units - {"cli", "__main__"} <= set(RANK), f"add to LAYERS: {sorted(units - set(RANK))}"


def test_imports_flow_one_way():
    bad = sorted(
        {
            f"{importer}:{line} imports {imported}"
            for importer, imported, line in edges()
            if upward(importer, imported) and not excused(importer, imported)
        }
    )
    assert not bad, "imports against the layering (see this test's docstring):\n" + "\n".join(bad)


def test_every_exception_is_still_needed():
    used = {(a, b) for a, b, _ in EXCEPTIONS if any(m == a and excused(m, t) and upward(m, t) for m, t, _ in edges())}
    stale = [(a, b) for a, b, _ in EXCEPTIONS if (a, b) not in used]
    assert not stale, f"no longer imported; remove from EXCEPTIONS: {stale}"


def test_the_checker_sees_an_upward_import(tmp_path):
    # a function-level import of the trainer from data, the kind of edge this test exists for
    fake = PACKAGE / "data" / "x.py"
    node = ast.parse("def f():\n    from kilolayer.train.loop import Trainer\n").body[0].body[0]
    (target,) = resolve(fake, node)
    assert target == "kilolayer.train.loop" and upward("kilolayer.data.x", target)
    assert upward("kilolayer.study.runner", "kilolayer.analysis.cli")  # a CLI module from below the edge
    assert not upward("kilolayer.analysis.smoothness", "kilolayer.rundir")
    assert upward("kilolayer.nn.layers", "kilolayer.data.base")  # siblings


def cycles() -> list[list[str]]:
    """The import cycles among kilolayer modules (each as the modules around it, the first one repeated last)."""
    graph: dict[str, set[str]] = {}
    for importer, imported, _ in edges():
        if importer != imported:
            graph.setdefault(importer, set()).add(imported)
    found, state, path = [], {}, []  # state: 1 on the current path, 2 done

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles():
    found = cycles()
    assert not found, "import cycles (move the shared piece to the lower module):\n" + "\n".join(
        " -> ".join(c) for c in found
    )
