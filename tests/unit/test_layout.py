"""The package's shape: no module imports one that imports it back, not even from inside a
function (a deferred import hides a circle; it does not remove it)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hororing"


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path, name, modules):
    """The hororing modules ``path`` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level \
                else node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(candidate for candidate in candidates if candidate in modules)
    return found - {name}


def _graph():
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
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


def _is_package(name):
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def test_no_import_cycle_between_modules():
    assert _cycle(_graph()) is None, f"import cycle: {' -> '.join(_cycle(_graph()))}"


def test_the_cycle_finder_finds_one():
    assert _cycle({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z",
                                                                     "a.x"]
