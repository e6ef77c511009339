"""docs/design/2026-12-02-package-map.md stays true, and the package's imports run one way.

The map's tables name every module of ``torchtitan_tide/``, ``models/`` and ``scripts/``
(first column, in backticks: a path relative to the folder of the section heading, or from
the repository root under "## models/, scripts/"), and nothing that does not exist. The
imports between ``torchtitan_tide`` modules (every ``import`` statement, also those inside
functions) form no circle.
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "design" / "2026-12-02-package-map.md"
MODULE_SUFFIXES = (".py", ".sh", ".sbatch")


def _map_entries() -> set[str]:
    """Repository paths of the files the map's tables name."""
    entries, folder = set(), ""
    for line in MAP.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip().strip("`")
            folder = "" if "," in heading else heading
            continue
        if not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first_cell):
            if name.endswith(MODULE_SUFFIXES):
                entries.add(folder + name)
    return entries


def _modules() -> set[str]:
    found = set()
    for top in ("torchtitan_tide", "models", "scripts"):
        for path in (REPO / top).rglob("*"):
            if path.suffix in MODULE_SUFFIXES and "__pycache__" not in path.parts:
                found.add(path.relative_to(REPO).as_posix())
    return found


def test_the_map_names_every_module_and_only_modules_that_exist():
    named, present = _map_entries(), _modules()
    assert named, f"no file entries read from {MAP}"
    assert not present - named, f"modules missing from {MAP.name}: {sorted(present - named)}"
    assert not named - present, f"{MAP.name} names files that do not exist: {sorted(named - present)}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The ``torchtitan_tide`` modules ``path`` imports (submodules where the name is one)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import sub` imports the submodule; `from mod import name`, mod
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                        for a in node.names]  # fmt: skip
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_package():
    paths = [p for p in (REPO / "torchtitan_tide").rglob("*.py") if "__pycache__" not in p.parts]
    known = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, known) for p in paths}
    assert "torchtitan_tide.launch.job_config" in graph["torchtitan_tide.launch.checks"]
    # a relative import, two levels up
    assert "torchtitan_tide.comm.plans.plan" in graph["torchtitan_tide.comm.fsdp.install_groups"]
    circles = _circles(graph)
    assert not circles, f"import circles: {circles}"
    # The trainer uses the launcher's argument parsing; the launcher never imports the trainer.
    launcher = {m for m in graph if m.startswith("torchtitan_tide.launch")}
    for module in launcher:
        assert not graph[module] & {"torchtitan_tide.train", "torchtitan_tide.train_specs"}, module
