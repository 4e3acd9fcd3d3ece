"""Every name the project's code reads is defined: a static check, for the code paths CI cannot
run (cupy on a GPU, CUDA-aware MPI, a cluster's launcher), where a missing import would
otherwise surface only on such a machine, as a NameError in the middle of a job."""

import ast
import pathlib

from pyflakes import checker, messages

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("hororing", "kernels", "scripts", "examples", "tests")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


def _sources():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_the_tree_is_found():
    names = {path.relative_to(ROOT).as_posix() for path in _sources()}
    assert "hororing/gpu/cupy_memory.py" in names and len(names) > 100


def test_no_undefined_names():
    found = []
    for path in _sources():
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
        for message in checker.Checker(tree, filename=str(path)).messages:
            if isinstance(message, UNDEFINED):
                found.append(f"{path.relative_to(ROOT)}:{message.lineno}: "
                             f"{message.message % message.message_args}")
    assert not found, "names read but never defined (an import missing?):\n" + "\n".join(found)


def test_the_check_sees_a_missing_import():
    tree = ast.parse("def view(obj):\n    return torch_numpy_dtype(obj.dtype)\n")
    caught = [m for m in checker.Checker(tree, filename="probe.py").messages
              if isinstance(m, UNDEFINED)]
    assert [m.message_args for m in caught] == [("torch_numpy_dtype",)]
