"""No import cycles in gradverify's packages, counting imports inside functions and
``TYPE_CHECKING`` blocks: a cycle hidden behind a late import is still a cycle."""

from __future__ import annotations

import grimp

PACKAGES = ("gradvocab", "refgrad", "fastgrad", "verify", "examples")


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for i in range(next_edge, len(edges[node])):
                target = edges[node][i]
                if target not in index:
                    work.append((node, i + 1))
                    work.append((target, 0))
                    recurse = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if recurse:
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_the_cycle_finder_sees_a_cycle_through_a_late_import() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c", "d"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")  # e.g. inside a function
    graph.add_import(importer="c", imported="d")
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    # no cache: grimp's is keyed on file modification times, which a merge or checkout within
    # the same second leaves unchanged (a stale graph was seen to report removed imports)
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)
    cycles = import_cycles(graph)
    details = []
    for cycle in cycles:
        members = set(cycle)
        for importer in cycle:
            for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
                for line in graph.get_import_details(importer=importer, imported=imported):
                    details.append(f"{importer}:{line['line_number']} {line['line_contents']}")
    assert not cycles, "import cycles:\n" + "\n".join(map(str, cycles)) + "\n" + "\n".join(details)
