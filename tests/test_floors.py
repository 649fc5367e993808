"""Clean floors: hpc_train's packages stand on each other in one order, and no module imports a module on a
higher floor (at the top of the file or inside a function). A new package or top-level module gets a floor
here; the test names any module that has none. Floors are given to whole folders (and top-level modules),
never to a file inside a folder, so a folder stands on one floor; and no two folders import each other,
directly or round a loop of siblings on one floor."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hpc_train"

# low to high; a module's floor is that of its longest listed prefix. Equal floors are siblings.
FLOORS = {
    "hpc_train": 0,  # the package itself (its version)
    "hpc_train.errors": 0,
    "hpc_train.placement": 0,  # tensors laid out like a parameter: torch only
    "hpc_train.config": 1,  # the core schema, its composition, loading and value checks
    "hpc_train.data": 2,
    "hpc_train.observe": 2,  # metrics log, memory accounting, profiler
    "hpc_train.bootstrap": 3,  # rank bootstrap: a process's rank, node, process group
    "hpc_train.resilience": 4,  # faults, hangs, stragglers, preemption, bad nodes, restarts
    "hpc_train.launch": 5,  # submit (Slurm) and local spawn: the supervisors, above what they supervise
    "hpc_train.models": 6,
    "hpc_train.distributed": 7,  # parallelize: the mesh, the pipeline, gradients, the step hooks' protocol
    "hpc_train.optim": 8,
    "hpc_train.features": 9,  # one folder per feature, each a room of its own (`room`)
    "hpc_train.job": 10,  # the registry: the features, the schema they compose
    "hpc_train.planner": 12,
    "hpc_train.checkpoint": 13,
    "hpc_train.builder": 14,  # the composition root
    "hpc_train.train": 15,
    "hpc_train.commands": 16,
    "hpc_train.cli": 17,
}


def room(module: str) -> str | None:
    """The FLOORS entry a module stands in: its folder (or itself, a top-level module); under features/,
    each feature's folder (and features/feature.py) is a room of its own."""
    parts = module.split(".")
    if parts[:2] == ["hpc_train", "features"] and len(parts) > 2:
        return ".".join(parts[:3])
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return ".".join(parts[:n])
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int | None:
    """The floor of `module`: its longest prefix in FLOORS (the bare package only for itself)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    return FLOORS.get(module)


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imported(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every hpc_train import in the file, at any depth: `from a import b` is `a.b` where
    that is a module, else `a`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base) for a in node.names]
    return sorted({(line, name) for line, name in found if name.split(".")[0] == "hpc_train"})


def test_every_module_has_a_floor():
    missing = sorted(module_name(p) for p in ROOT.rglob("*.py") if floor(module_name(p)) is None)
    assert not missing, f"modules with no floor (add their package to FLOORS in tests/test_floors.py): {missing}"


def test_no_import_goes_up_a_floor():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        own = floor(module)
        for line, target in imported(path, module):
            if own is not None and (theirs := floor(target)) is not None and theirs > own:
                rel = path.relative_to(ROOT.parent)
                upward.append(f"{rel}:{line}: {module} (floor {own}) imports {target} (floor {theirs})")
    assert not upward, "imports up the floors:\n" + "\n".join(upward)


def test_floors_are_given_to_folders_not_to_files_inside_them():
    folders = [key for key in FLOORS if key != "hpc_train"]
    inside = sorted(key for key in folders for other in folders if key != other and key.startswith(f"{other}."))
    assert not inside, f"a folder stands on one floor; these name a part of a folder listed already: {inside}"


def test_no_two_folders_import_each_other():
    """A loop of imports between folders (and top-level modules) runs up a floor somewhere, even where every
    file-level import stays on or below its floor (siblings on one floor)."""
    edges: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        for _, target in imported(path, module):
            a, b = room(module), room(target)
            if a and b and a != b and a != "hpc_train" and b != "hpc_train":
                edges.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        nexts = edges.get(start, ())
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in nexts)

    loops = sorted(f"{a} -> {b} -> ... -> {a}" for a, targets in edges.items() for b in targets if reaches(b, a, {b}))
    assert not loops, "folders that import each other:\n" + "\n".join(loops)
