"""The repository's shape: its modules depend one way (no import cycles, counting the imports made inside functions,
which only hide one), and the roles meet only through the core."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("hivetrain", "coordinator", "peers", "baselines", "benchmarks", "scripts")
# The roles: hivetrain.roles.<role> (in the wheel) and the clone's entry scripts (coordinator/start.py, peers/join.py),
# baselines/ (a clone's tool)
ROLES = ("coordinator", "peers", "dashboard", "baselines")


def _modules() -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The repository's modules that `path` imports, anywhere in it (a function's lazy import counts)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from package import module`
    return {name for name in found if name in MODULES}


GRAPH = {module: _imports(path) - {module} for module, path in MODULES.items()}


def _area(module: str) -> str:
    """Where a module belongs: its role (hivetrain.roles.<role>..., or a role's folder), else its top-level folder
    (hivetrain: the core)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["hivetrain", "roles"] and len(parts) > 2 else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for neighbour in edges:
                if neighbour not in index:
                    index[neighbour] = low[neighbour] = counter
                    counter += 1
                    stack.append(neighbour)
                    on_stack.add(neighbour)
                    work.append((neighbour, iter(sorted(graph[neighbour]))))
                    break
                if neighbour in on_stack:
                    low[node] = min(low[node], index[neighbour])
            else:
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
                        components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert len(GRAPH) > 50 and "hivetrain.strategy" in GRAPH["hivetrain.roles.peers.join"]  # it read the repository
    assert _cycles(GRAPH) == []


def test_roles_meet_only_through_the_core():
    """The core imports no role; a role imports the core and itself only (peers need none of the coordinator's code,
    the dashboard none of the trainers'), and nothing imports a benchmark but the benchmarks and scripts."""
    def imported_areas(area: str) -> dict[str, set[str]]:
        return {module: {_area(name) for name in GRAPH[module]} for module in GRAPH if _area(module) == area}

    assert "hivetrain.roles.coordinator.start" in imported_areas("coordinator")  # roles inside the package count

    for module, areas in imported_areas("hivetrain").items():
        assert areas <= {"hivetrain"}, module
    for role in ROLES:
        for module, areas in imported_areas(role).items():
            assert areas <= {"hivetrain", role}, module


def _top_level_imports(path: Path) -> set[str]:
    """The top-level packages `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_a_join_imports_no_other_role_and_none_of_their_libraries():
    """What `peers/join.py` can import, lazily too: the core and the peer's own code, never the coordinator's, the
    dashboard's or the benchmarks', nor the libraries only those need (a volunteer installs `hivetrain` alone)."""
    reached, todo = set(), ["peers.join"]  # the clone's entry script, and through it hivetrain.roles.peers
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(GRAPH[module])
    assert "hivetrain.strategy" in reached
    assert "hivetrain.roles.peers.join" in reached
    assert {_area(module) for module in reached} <= {"hivetrain", "peers"}, sorted(reached)
    # boto3 is imported for s3:// checkpoint URIs only (hivetrain.checkpoint_location), which a join never names
    libraries = set().union(*(_top_level_imports(MODULES[module]) for module in reached - {"hivetrain.s3_store"}))
    assert not libraries & {"streamlit", "boto3", "pandas", "altair", "matplotlib", "tensorboard"}, sorted(libraries)
