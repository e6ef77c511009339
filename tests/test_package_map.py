"""docs/design/2026-12-02-package-map.md stays true, and the package's imports run one way.

The map's tables name every module of ``torchtitan_tide/``, ``models/`` and ``scripts/``
(first column, in backticks: a path relative to the folder of the section heading, or from
the repository root under "## models/, scripts/"), and nothing that does not exist. The
imports between ``torchtitan_tide`` modules (every ``import`` statement, also those inside
functions) form no circle; inside ``comm/`` they run down its layers
(docs/design/2026-12-07-comm-rooms.md); no folder of ``scripts/`` or ``tests/`` has a circle.
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


def _package_paths() -> list[Path]:
    return [p for p in (REPO / "torchtitan_tide").rglob("*.py") if "__pycache__" not in p.parts]


def _package_graph() -> dict[str, set[str]]:
    paths = _package_paths()
    known = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, known) for p in paths}


def test_no_import_circle_in_the_package():
    graph = _package_graph()
    assert "torchtitan_tide.launch.job_config" in graph["torchtitan_tide.launch.checks"]
    # a relative import, two levels up
    assert "torchtitan_tide.comm.plans.plan" in graph["torchtitan_tide.comm.fsdp.install_groups"]
    circles = _circles(graph)
    assert not circles, f"import circles: {circles}"
    # The trainer uses the launcher's argument parsing; the launcher never imports the trainer.
    launcher = {m for m in graph if m.startswith("torchtitan_tide.launch")}
    for module in launcher:
        assert not graph[module] & {"torchtitan_tide.train", "torchtitan_tide.train_specs"}, module


# comm's layers, top to bottom (docs/design/2026-12-07-comm-rooms.md): a module imports only
# from its own layer or a lower one. A module belongs to the layer of its longest prefix here.
COMM = "torchtitan_tide.comm"
COMM_LAYERS = (
    (COMM, f"{COMM}.symm_mem"),  # the API (the package's __init__ only) and the symm_mem mode
    (f"{COMM}.fsdp",),  # the FSDP2 seam: patch, internals, TIDE-AG, TIDE-RS, install
    (f"{COMM}.transports.windows",),  # NCCL windows, a transport
    (f"{COMM}.transports",),  # the interface, p2p, the copy engine
    (f"{COMM}.plans",),  # pure Python plans (topology reads devices)
    (f"{COMM}.base", f"{COMM}.options"),  # streams, kernels, ranks, guards; the [tide] options
)
COMM_MAX_LINES = 850


def _comm_layer(module: str) -> int:
    """The index in :data:`COMM_LAYERS` of ``module`` (a ``comm`` module): the layer of its
    longest prefix (``comm`` itself matches only the package's ``__init__``)."""
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(COMM_LAYERS) for prefix in prefixes
        if module == prefix or (prefix != COMM and module.startswith(prefix + "."))
    ]  # fmt: skip
    assert matches, f"{module} is in no layer of COMM_LAYERS"
    return max(matches)[1]


def test_comm_imports_run_down_its_layers():
    graph = _package_graph()
    comm = {m for m in graph if m == COMM or m.startswith(COMM + ".")}
    assert f"{COMM}.transports.windows.transport" in comm, sorted(comm)
    upward = sorted(
        f"{m} ({_comm_layer(m)}) -> {t} ({_comm_layer(t)})"
        for m in comm for t in graph[m] if t in comm and _comm_layer(t) < _comm_layer(m)
    )  # fmt: skip
    assert not upward, "comm imports that run up its layers:\n" + "\n".join(upward)


def test_a_collective_walks_at_most_four_comm_packages():
    """From the FSDP2 seam's collectives, and from every transport they call, the imports
    reach at most four of comm's packages: fsdp, transports (windows inside), plans, base."""
    graph = _package_graph()

    def packages(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += [t for t in graph[module] if t.startswith(COMM + ".")]
        return {m.split(".")[2] for m in seen if m.count(".") >= 3}  # comm.<package>.<module>

    starts = [f"{COMM}.fsdp.patch", f"{COMM}.fsdp.all_gather", f"{COMM}.fsdp.reduce_scatter"]
    starts += [m for m in graph if m.startswith(f"{COMM}.transports.")]
    for start in starts:
        reached = packages(start) | {"fsdp"}
        assert reached <= {"fsdp", "transports", "plans", "base"}, (start, reached)


def test_comm_packages_say_what_they_own_and_may_import():
    for path in sorted((REPO / "torchtitan_tide" / "comm").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        lines = len(path.read_text().splitlines())
        assert lines <= COMM_MAX_LINES, f"{path.relative_to(REPO)}: {lines} lines"
        if path.name == "__init__.py" and path.parent.name != "comm":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "Owns:" in doc and "May import:" in doc, path.relative_to(REPO)


def _sibling_imports(path: Path) -> set[str]:
    """The modules of ``path``'s own folder that it imports, at load or inside a function."""
    siblings = {p.stem for p in path.parent.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return (found & siblings) - {path.stem}


def test_no_import_circle_in_scripts_or_tests():
    """No module of a folder of ``scripts/`` or ``tests/`` imports, at load or lazily, a
    sibling that imports it back (directly or through others): bench_interference.py and
    interference_one_gpu.py did (issue 46; the GEMMs both time live in gemms.py). Test
    helpers (``_harness.py``, ``_layouts.py``, a test reusing another's checks) are siblings
    imported by name the same way."""
    folders = sorted({p.parent for top in ("scripts", "tests") for p in (REPO / top).rglob("*.py")})
    assert REPO / "tests" / "comm" in folders and REPO / "scripts" / "bench" in folders
    for folder in folders:
        graph = {p.stem: _sibling_imports(p) for p in folder.glob("*.py")}
        assert not _circles(graph), f"{folder.relative_to(REPO)}: import circle {_circles(graph)}"
    bench = REPO / "scripts" / "bench"
    assert "bench_interference" not in _sibling_imports(bench / "interference_one_gpu.py")
