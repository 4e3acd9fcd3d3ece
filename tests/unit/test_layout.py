"""The package's shape: no module imports one that imports it back, not even from inside a
function (a deferred import hides a circle; it does not remove it)."""

import ast
import functools
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hororing"


def modules(package=PACKAGE):
    """Every module of the installed package by name, with its path: hororing/, and the
    repository's top-level kernels/, which installs as hororing.kernels (setup.py)."""
    roots = [(package, ("hororing",)), (package.parent / "kernels", ("hororing", "kernels"))]
    found = {}
    for root, prefix in roots:
        for path in root.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path, name, modules):
    """The hororing modules ``path`` imports, anywhere in it."""
    return {target for target, _ in _module_imports(path, name, modules)}


def _graph():
    paths = modules()
    return {name: _imports(path, name, paths) for name, path in paths.items()}


def _cycle(graph):
    """One import cycle among modules (package __init__ files excepted), or None."""
    state = {}

    def visit(name, trail):
        state[name] = "open"
        for other in sorted(graph[name]):
            if other in graph and graph[other] is not None and not _is_package(other):
                if state.get(other) == "open":
                    return trail[trail.index(other):] + [other]
                if other not in state:
                    found = visit(other, trail + [other])
                    if found:
                        return found
        state[name] = "done"
        return None
    for name in sorted(graph):
        if name not in state and not _is_package(name):
            found = visit(name, [name])
            if found:
                return found
    return None


@functools.lru_cache(maxsize=None)
def _packages():
    return frozenset(name for name, path in modules().items() if path.name == "__init__.py")


def _is_package(name):
    return name in _packages()


def test_no_import_cycle_between_modules():
    assert _cycle(_graph()) is None, f"import cycle: {' -> '.join(_cycle(_graph()))}"


def test_the_cycle_finder_finds_one():
    assert _cycle({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z",
                                                                     "a.x"]


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def read_floors(text):
    """The floors of docs/architecture.md's table ("The floors, as the layout test reads
    them"), top to bottom: [(floor, [module prefixes])]. A module imports modules of its own
    floor or of a floor below, never above; a module outside the engine imports only the
    engine's face (hororing.engine's __all__). A module belongs to the floor of its longest
    listed prefix."""
    section = text.split("## The floors, as the layout test reads them", 1)[1].split("\n## ", 1)[0]
    floors = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 2 or cells[0] in ("floor", "---"):
            continue
        floors.append((cells[0], [module.strip() for module in cells[1].split(",")]))
    return floors


FLOORS = read_floors(ARCHITECTURE.read_text())


def _floor(name, floors=FLOORS):
    """(depth, floor name) of module ``name``: 0 the top floor."""
    best = None
    for depth, (floor, prefixes) in enumerate(floors):
        for prefix in prefixes:
            exact_only = prefix == "hororing"
            if name == prefix or (not exact_only and name.startswith(prefix + ".")):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), depth, floor)
    assert best is not None, f"{name} is on no floor of docs/architecture.md (FLOORS)"
    return best[1:]


def _module_imports(path, name, modules):
    """[(module imported, names taken from it)] for every import in ``path``: ``from X import
    y`` is an import of X.y where that is a module, else of X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level \
                else node.module or ""
            names = []
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    found.append((f"{target}.{alias.name}", ()))
                else:
                    names.append(alias.name)
            if names and target in modules:
                found.append((target, tuple(names)))
        elif isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names if alias.name in modules]
    return [(target, names) for target, names in found if target != name]


def floor_violations(package=PACKAGE, floors=FLOORS):
    """Every import that runs up a floor or past the engine's face, as readable lines."""
    paths = modules(package)
    face = _engine_face(package)
    found = []
    for name, path in sorted(paths.items()):
        depth, floor = _floor(name, floors)
        for target, names in _module_imports(path, name, paths):
            target_depth, target_floor = _floor(target, floors)
            if target_depth < depth:
                found.append(f"{name} ({floor}) imports {target} ({target_floor}), a floor up")
            inside = name == "hororing.engine" or name.startswith("hororing.engine.")
            if not inside and target.startswith("hororing.engine."):
                found.append(f"{name} imports {target}: outside the engine, import its face "
                             f"(hororing.engine)")
            if not inside and target == "hororing.engine":
                hidden = sorted(set(names) - face)
                if hidden:
                    found.append(f"{name} imports {hidden} from hororing.engine, which are not "
                                 f"in its __all__")
    return found


def _engine_face(package):
    tree = ast.parse((package / "engine" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__"
                                                for target in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_every_import_goes_down_the_floors_and_through_the_engines_face():
    violations = floor_violations()
    assert not violations, "\n".join(violations)


def test_the_floor_check_finds_an_import_up_and_one_past_the_face(tmp_path):
    package = tmp_path / "hororing"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("__all__ = ['Engine']\n")
    (package / "engine" / "cycle.py").write_text("")
    (package / "ops.py").write_text("from . import collectives\n")
    (package / "collectives.py").write_text("from .engine import Engine, Cycle\n"
                                            "from .engine.cycle import x\n")
    assert floor_violations(package) == [
        "hororing.collectives imports ['Cycle'] from hororing.engine, which are not in its "
        "__all__",
        "hororing.collectives imports hororing.engine.cycle: outside the engine, import its "
        "face (hororing.engine)",
        "hororing.ops (MPI and leaves) imports hororing.collectives (verbs), a floor up"]


BINDINGS = ("torch", "tensorflow", "keras")


def engine_reaches(package=PACKAGE, bindings=BINDINGS):
    """Every place a binding reaches into an engine object (an attribute named ``engine``),
    as readable lines: the bindings ask what they need of ``hororing.door`` instead."""
    found = []
    for binding in bindings:
        for path in sorted((package / binding).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "engine":
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} reaches "
                                 f"into .engine")
    return found


def test_no_binding_reaches_into_an_engine():
    reaches = engine_reaches()
    assert not reaches, "\n".join(reaches)


def test_the_engine_reach_check_finds_one(tmp_path):
    package = tmp_path / "hororing"
    (package / "torch").mkdir(parents=True)
    (package / "torch" / "ok.py").write_text("from .. import door\ndoor.check_free('x')\n")
    (package / "torch" / "bad.py").write_text("def f(group):\n    return group.engine.route\n")
    assert engine_reaches(package, ("torch",)) == ["hororing/torch/bad.py:2 reaches into .engine"]


def test_the_floors_come_from_docs_architecture_and_cover_kernels():
    names = [floor for floor, _ in FLOORS]
    assert names[0] == "the horovod alias" and names[-1] == "MPI and leaves"
    assert len(names) == len(set(names)) == 10
    assert "hororing.kernels.reduce" in modules()  # the top-level kernels/, as installed
    assert _floor("hororing.kernels.reduce") == (9, "MPI and leaves")
    assert _floor("hororing.reducer") == (3, "above the engine")


def test_a_kernel_that_imports_up_a_floor_is_found(tmp_path):
    package = tmp_path / "hororing"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("__all__ = []\n")
    (package / "collectives.py").write_text("")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "scale.py").write_text("from ..collectives import allreduce\n")
    assert floor_violations(package) == [
        "hororing.kernels.scale (MPI and leaves) imports hororing.collectives (verbs), a floor up"]
