"""The package's layering (pyproject.toml's import-linter contracts: commands > lab > sizing > run > the step >
its parts > models) holds, and no module imports itself back through others (imports under TYPE_CHECKING, for
annotations only, are exempt): the next change cannot quietly add an upward import or a circle."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import grimp

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def test_import_linter_contracts_are_kept():
    # what `lint-imports` runs (.ci/run calls it too), from the repository root so that this tree's jopd is read
    done = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _import_circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
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
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_anywhere():
    graph = grimp.build_graph("jopd", exclude_type_checking_imports=True)
    assert _import_circles(graph) == []


def test_the_circle_check_finds_a_circle():
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    assert _import_circles(graph) == []
    graph.add_import(importer="p.c", imported="p.a")
    assert _import_circles(graph) == [["p.a", "p.b", "p.c"]]
