"""The package installs from a built wheel with hororing.kernels, and imports lightly."""

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_does_not_pull_in_frameworks_or_start_mpi():
    # importing mpi4py.MPI initializes MPI: that belongs to hvd.init(), not to the import;
    # ml_dtypes (a second to import) waits for the first bfloat16 array (ops.bfloat16)
    code = ("import sys, hororing, hororing.kernels, hororing.engine.negotiation; "
            "print(sorted(m for m in ('torch', 'cupy', 'numba', 'mpi4py.MPI', 'ml_dtypes') "
            "if m in sys.modules))")
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert output.stdout.strip() == "[]"
    code = ("import hororing as hvd; hvd.init(); from mpi4py import MPI; "
            "print(MPI.Is_initialized(), hvd.size()); hvd.shutdown()")
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert output.stdout.split() == ["True", "1"]


def test_wheel_contains_kernels_and_imports(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("hororing-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hororing/kernels/reduce.py" in names
    assert not any(name.startswith("kernels/") for name in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    code = "import hororing, hororing.kernels; print(hororing.__file__)"
    output = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
                            check=True, capture_output=True, text=True, cwd=tmp_path)
    assert output.stdout.strip().startswith(str(target))
