"""The house's layering rules, read from the source with `ast`: who may import zmq, and who may import whom.

The rules (docs/architecture.md, "Where things live", says the same for a newcomer):
- networking lives only in protocol/ and the two event loops;
- the learner's folders are floors, top to bottom LEARNER_FLOORS: an import points down (or stays in its
  folder) only, type-level (`if TYPE_CHECKING:`) and lazy (inside a function) imports included. The step
  is the ground floor and imports no other learner folder; the run's coordinator is the top;
- nothing in the package, bench/ included, imports in a circle: not file to file, and not folder to folder;
- bench/ reaches the package through public names only: it imports no name that starts with `_`, from
  the package or from another bench module, and reads no other object's `_attribute`.
"""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "grpo_fleet"

# Networking lives only in protocol/ and the two event loops (the actor's link is part of its loop,
# the learner's doorman of its own: it watches the loop's router).
ZMQ_ALLOWED = ("protocol/*", "learner/door/server.py", "learner/door/doorman.py", "actor/worker.py", "actor/link.py")


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` imports, at any depth (lazy imports inside functions too), made absolute.

    `package` is the dotted package the module lives in, for relative imports. A
    `from pkg import name` counts as importing `pkg` and `pkg.name` (name may be a module).
    """
    parts = package.split(".")
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _imports(names: set[str], prefix: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for name in names)


def _package_imports() -> dict[str, set[str]]:
    """'learner/door/server.py' -> the modules it imports, for every module of grpo_fleet."""
    table = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        package = ".".join(["grpo_fleet", *relative.parent.parts])
        table[relative.as_posix()] = imported_modules(path.read_text(), package)
    return table


def _offenders(rooms: str, forbidden: str) -> list[str]:
    return [name for name, names in _package_imports().items() if fnmatch(name, rooms) and _imports(names, forbidden)]


def test_the_walk_sees_lazy_relative_and_from_imports():
    source = "import os\ndef f():\n    import zmq.auth\nfrom . import codec\nfrom ..learner import core\n"
    names = imported_modules(source, "grpo_fleet.protocol")
    assert {"os", "zmq.auth", "grpo_fleet.protocol.codec", "grpo_fleet.learner.core"} <= names
    assert _imports(names, "zmq") and _imports(names, "grpo_fleet.learner") and not _imports(names, "zmq_extra")


def test_the_walk_reads_the_whole_package():
    table = _package_imports()
    assert "protocol/sockets.py" in table and _imports(table["protocol/sockets.py"], "zmq")


def test_only_protocol_and_the_two_loops_import_zmq():
    offenders = [
        name for name, names in _package_imports().items()
        if _imports(names, "zmq") and not any(fnmatch(name, allowed) for allowed in ZMQ_ALLOWED)
    ]
    assert not offenders, f"open sockets through grpo_fleet.protocol instead: {offenders}"


def test_the_model_does_not_know_the_wire():
    assert _package_imports()["models/loading.py"] and not _offenders("models/*", "grpo_fleet.protocol")


def _module_file(table: dict[str, set[str]]) -> dict[str, str]:
    """'grpo_fleet.learner.door.server' -> 'learner/door/server.py' (a package -> its __init__.py)."""
    names = {}
    for name in table:
        dotted = "grpo_fleet." + name.removesuffix(".py").replace("/", ".")
        names[dotted.removesuffix(".__init__")] = name
    return names


def reachable(start: str, table: dict[str, set[str]]) -> dict[str, str]:
    """Every module of the package `start` imports directly or through others, each with the one it came from."""
    files = _module_file(table)
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for name in table[current]:
            target = files.get(name)
            if target is not None and target != start and target not in came_from:
                came_from[target] = current
                todo.append(target)
    return came_from


def test_the_walk_follows_imports_through_other_modules():
    table = {"a.py": {"grpo_fleet.b"}, "b.py": {"grpo_fleet.actor.c"}, "actor/c.py": set(), "d.py": set()}
    assert reachable("a.py", table) == {"b.py": "a.py", "actor/c.py": "b.py"}
    assert reachable("d.py", table) == {}


def test_the_learner_does_not_import_the_actor_even_through_other_modules():
    table = _package_imports()
    chains = []
    for name in table:
        if fnmatch(name, "learner/*"):
            came_from = reachable(name, table)
            for target in (t for t in came_from if t.startswith("actor/")):
                chain = [target]
                while chain[-1] != name:
                    chain.append(came_from[chain[-1]])
                chains.append(" <- ".join(chain))
    assert not chains, f"the learner reaches the actor: {chains}"


def test_a_production_actor_has_no_lie_switch():
    """The corrupted actors of the tests live in tests/liars/: nothing installed can be told to lie."""
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}
    assert "actor/corruption.py" not in modules
    assert not any(_imports(imported, "grpo_fleet.actor.corruption") for imported in _package_imports().values())
    mentions = [name for name in sorted(modules)
                if "GRPO_FLEET_TEST_CORRUPT" in (PACKAGE / name).read_text(encoding="utf-8")]
    assert mentions == [], f"the lie switch is read in {mentions}"


def _calls_mx_distributed(source: str) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
               and node.value.id == "mx" for node in ast.walk(ast.parse(source)))


def test_only_the_collectives_module_runs_mx_distributed():
    """Every collective goes through learner/ranks/collectives.py, so every one runs under its watchdog."""
    assert _calls_mx_distributed("import mlx.core as mx\nmx.distributed.all_sum(x)\n")
    users = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                   if _calls_mx_distributed(path.read_text(encoding="utf-8")))
    assert users == ["learner/ranks/collectives.py"]


def _cycles_in(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle through each node of `graph` that is on one (a node's edges are the nodes it imports)."""
    found = []
    for start in graph:
        came_from: dict[str, str] = {}
        todo = [start]
        while todo and start not in came_from:
            current = todo.pop()
            for target in graph.get(current, []):
                if target not in came_from:
                    came_from[target] = current
                    todo.append(target)
        if start in came_from:
            chain = [start, came_from[start]]
            while chain[-1] != start:
                chain.append(came_from[chain[-1]])
            found.append(chain[::-1])
    return found


def cycles(table: dict[str, set[str]], rooms: str) -> list[list[str]]:
    """The import cycles among the modules matching `rooms`, every import counted (lazy and TYPE_CHECKING ones too)."""
    files = _module_file(table)
    graph = {name: sorted({files[n] for n in names if n in files and files[n] != name and fnmatch(files[n], rooms)})
             for name, names in table.items() if fnmatch(name, rooms)}
    return _cycles_in(graph)


def test_the_cycle_walk_finds_a_cycle_through_other_modules():
    table = {"learner/a.py": {"grpo_fleet.learner.b"}, "learner/b.py": {"grpo_fleet.learner.c"},
             "learner/c.py": {"grpo_fleet.learner.a"}, "learner/d.py": {"grpo_fleet.learner.a"}}
    assert cycles(table, "learner/*")[0] == ["learner/a.py", "learner/b.py", "learner/c.py", "learner/a.py"]
    assert len(cycles(table, "learner/*")) == 3 and cycles(table, "actor/*") == []


def test_the_package_imports_in_no_circle():
    """Not even at type level or lazily, bench/ included: what two modules share gets a module of its own
    (learner/records/state.py: AckCache, tasks/examples.py, bench/learner_process.py)."""
    found = cycles(_package_imports(), "*")
    assert not found, f"import cycles: {[' -> '.join(chain) for chain in found]}"


# ---------------------------------------------------------------- folders: the learner's floors, and no folder loops

# verify/ (what judges actors) sits under the door and actors/, whose intake and registry call it, and over the
# step, whose in-step math (fused_check, recheck, gap_bounds) it plans and reads.
LEARNER_FLOORS = ("run", "evals", "door", "actors", "verify", "ranks", "records", "step")  # top to bottom


def room(name: str) -> str:
    """The folder a module lives in, as a room of the house: 'learner/door' for learner/door/intake.py,
    'bench' for bench/hostile.py, the module itself ('config.py') for one at the top of the package."""
    parts = name.split("/")
    if parts[0] == "learner" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0]


def _floor(name: str) -> int | None:
    """How far down the learner's floors a module lives (0 is the top); None outside them (or on no floor)."""
    here = room(name).split("/")
    return LEARNER_FLOORS.index(here[1]) if len(here) == 2 and here[1] in LEARNER_FLOORS else None


def _arrows(table: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import of one package module by another, every import counted."""
    files = _module_file(table)
    return [(name, target) for name, names in table.items()
            for target in sorted({files[n] for n in names if n in files}) if target != name]


def back_arrows(table: dict[str, set[str]]) -> list[str]:
    """Every import of a learner module by one on a lower floor: an arrow that points back up."""
    found = []
    for source, target in _arrows(table):
        low, high = _floor(source), _floor(target)
        if low is not None and high is not None and high < low:
            found.append(f"{source} -> {target}")
    return found


def folder_loops(table: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among the rooms (learner/<floor>, bench, protocol, cli/main.py, ...), though no module cycle need exist."""
    graph: dict[str, set[str]] = {}
    for source, target in _arrows(table):
        if room(source) != room(target):
            graph.setdefault(room(source), set()).add(room(target))
    return _cycles_in({name: sorted(targets) for name, targets in graph.items()})


def test_the_walks_find_a_back_arrow_a_circle_and_a_folder_loop():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo_fleet.learner.run.rooms import RunRooms\n"
    table = {
        "learner/step/a.py": imported_modules(source, "grpo_fleet.learner.step"),  # at type level only
        "learner/run/rooms.py": {"grpo_fleet.learner.step.a"},
        "learner/door/p.py": {"grpo_fleet.learner.actors.q"},
        "learner/actors/q.py": set(),
        "learner/actors/r.py": {"grpo_fleet.learner.door.s"},  # door -> actors -> door, though no module cycle
        "learner/door/s.py": set(),
        "bench/x.py": {"grpo_fleet.bench.y"},
        "bench/y.py": {"grpo_fleet.bench.x"},
    }
    assert back_arrows(table) == ["learner/step/a.py -> learner/run/rooms.py", "learner/actors/r.py -> learner/door/s.py"]
    assert [" -> ".join(c) for c in cycles(table, "*")] == [
        "learner/step/a.py -> learner/run/rooms.py -> learner/step/a.py",
        "learner/run/rooms.py -> learner/step/a.py -> learner/run/rooms.py",
        "bench/x.py -> bench/y.py -> bench/x.py", "bench/y.py -> bench/x.py -> bench/y.py"]
    loops = {" -> ".join(c) for c in folder_loops(table)}
    assert {"learner/door -> learner/actors -> learner/door", "learner/step -> learner/run -> learner/step"} <= loops
    downward = {"learner/run/rooms.py": {"grpo_fleet.learner.step.a"}, "learner/step/a.py": set(), "bench/x.py": set()}
    assert back_arrows(downward) == [] and cycles(downward, "*") == [] and folder_loops(downward) == []


def test_every_learner_module_lives_on_a_floor():
    """A new folder (or a module loose in learner/) would be outside the rules: it gets a floor first."""
    assert _floor("learner/door/x.py") == 2 and _floor("learner/attic/x.py") is None and _floor("learner/x.py") is None
    loose = [name for name in _package_imports()
             if name.startswith("learner/") and name != "learner/__init__.py" and _floor(name) is None]
    assert loose == []


def test_the_learner_imports_point_down_only():
    found = back_arrows(_package_imports())
    assert not found, f"arrows back up the learner's floors {LEARNER_FLOORS}: {found}"


def test_the_step_imports_no_other_learner_folder():
    found = [f"{source} -> {target}" for source, target in _arrows(_package_imports())
             if room(source) == "learner/step" and target.startswith("learner/") and room(target) != "learner/step"
             and target != "learner/__init__.py"]
    assert found == []


def test_no_folder_loops_in_the_package():
    found = folder_loops(_package_imports())
    assert not found, f"folder loops: {[' -> '.join(chain) for chain in found]}"


# ---------------------------------------------------------------- bench/: public names only


def private_imports(source: str, package: str) -> list[str]:
    """'module:name' for each name starting with `_` that `source` imports from grpo_fleet (a dunder is no secret)."""
    found = []
    parts = package.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [f"{module}:{alias.name}" for alias in node.names if module.startswith("grpo_fleet")
                      and alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_the_private_name_walk_sees_absolute_relative_and_lazy_imports():
    source = ("from grpo_fleet.bench.ingest import _start, public\nfrom .e2e import _config\n"
              "def f():\n    from grpo_fleet.learner.step.trainer import _x\nfrom os import _exit\n"
              "from grpo_fleet.x import __all__\n")
    assert sorted(private_imports(source, "grpo_fleet.bench")) == [
        "grpo_fleet.bench.e2e:_config", "grpo_fleet.bench.ingest:_start", "grpo_fleet.learner.step.trainer:_x"]


def _bench_sources() -> list[Path]:
    return sorted((PACKAGE / "bench").rglob("*.py"))


def test_the_bench_imports_no_private_name():
    found = [f"{path.relative_to(PACKAGE)}: {name}" for path in _bench_sources()
             for name in private_imports(path.read_text(encoding="utf-8"), "grpo_fleet.bench")]
    assert found == [], f"bench/ imports private names: {found}"


def private_attributes(source: str) -> list[str]:
    """`x._name` reads of another object's private attribute (`self._name` and `cls._name` are its own)."""
    return [f"{node.value.id}.{node.attr}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
            and not node.attr.startswith("__") and node.value.id not in ("self", "cls")]


def test_the_bench_reads_no_private_attribute():
    assert private_attributes("trainer._references(m)\nself._x = 1\nos.__name__\n") == ["trainer._references"]
    found = [f"{path.relative_to(PACKAGE)}: {name}" for path in _bench_sources()
             for name in private_attributes(path.read_text(encoding="utf-8"))]
    assert found == [], f"bench/ reads private attributes: {found}"


# The pure math: arrays in, arrays out, checked against NumPy references. It knows no other room.
PURE_MATH = ("learner/step/grpo.py", "learner/step/advantages.py", "learner/step/offpolicy.py", "learner/step/logprobs.py",
             "learner/step/vector_exp.py")


def test_the_pure_math_imports_only_the_pure_math():
    table = _package_imports()
    files = _module_file(table)
    # native/__init__.py loads the compiled exp kernel (native/vector_exp.cpp): math too, in C++
    allowed = {*PURE_MATH, "runtime/trees.py", "__init__.py", "learner/__init__.py", "learner/step/__init__.py",
               "native/__init__.py"}
    reached = {name: sorted(files[n] for n in table[name] if n in files and files[n] not in allowed) for name in PURE_MATH}
    assert reached == {name: [] for name in PURE_MATH}
