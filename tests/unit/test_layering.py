"""The house's layering rules, read from the source with `ast`: who may import zmq, and who may import whom."""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "grpo_fleet"

# DESIGN.md: networking lives only in protocol/ and the two event loops (the actor's link is part of its loop,
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
    assert not _offenders("model.py", "grpo_fleet.protocol") and not _offenders("tiny_model.py", "grpo_fleet.protocol")


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


def cycles(table: dict[str, set[str]], rooms: str) -> list[list[str]]:
    """The import cycles among the modules matching `rooms`, every import counted (lazy and TYPE_CHECKING ones too)."""
    files = _module_file(table)
    graph = {name: sorted({files[n] for n in names if n in files and files[n] != name and fnmatch(files[n], rooms)})
             for name, names in table.items() if fnmatch(name, rooms)}
    found = []
    for start in graph:
        came_from: dict[str, str] = {}
        todo = [start]
        while todo and start not in came_from:
            current = todo.pop()
            for target in graph[current]:
                if target not in came_from:
                    came_from[target] = current
                    todo.append(target)
        if start in came_from:
            chain = [start, came_from[start]]
            while chain[-1] != start:
                chain.append(came_from[chain[-1]])
            found.append(chain[::-1])
    return found


def test_the_cycle_walk_finds_a_cycle_through_other_modules():
    table = {"learner/a.py": {"grpo_fleet.learner.b"}, "learner/b.py": {"grpo_fleet.learner.c"},
             "learner/c.py": {"grpo_fleet.learner.a"}, "learner/d.py": {"grpo_fleet.learner.a"}}
    assert cycles(table, "learner/*")[0] == ["learner/a.py", "learner/b.py", "learner/c.py", "learner/a.py"]
    assert len(cycles(table, "learner/*")) == 3 and cycles(table, "actor/*") == []


@pytest.mark.parametrize("rooms", ["learner/*", "tasks/*"])
def test_the_rooms_import_each_other_without_cycles(rooms):
    """Not even at type level or lazily: what two modules share gets a module of its own (learner/records/acks.py,
    learner/fleet/moving_average.py, tasks/examples.py)."""
    found = cycles(_package_imports(), rooms)
    assert not found, f"import cycles in {rooms}: {[' -> '.join(chain) for chain in found]}"


# The pure math: arrays in, arrays out, checked against NumPy references. It knows no other room.
PURE_MATH = ("learner/step/grpo.py", "learner/step/advantages.py", "learner/step/offpolicy.py", "learner/step/logprobs.py")


def test_the_pure_math_imports_only_the_pure_math():
    table = _package_imports()
    files = _module_file(table)
    allowed = {*PURE_MATH, "trees.py", "__init__.py", "learner/__init__.py", "learner/step/__init__.py"}
    reached = {name: sorted(files[n] for n in table[name] if n in files and files[n] not in allowed) for name in PURE_MATH}
    assert reached == {name: [] for name in PURE_MATH}
