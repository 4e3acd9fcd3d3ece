"""scripts/bench_keras.py end to end with a few steps: every variant runs and is reported."""

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import mpiexec

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")
SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_keras.py"


def test_bench_keras_reports_every_variant(tmp_path):
    output = tmp_path / "keras.json"
    job = subprocess.run([sys.executable, str(SCRIPT), "--mpiexec", mpiexec(), "--steps", "2",
                          "--rounds", "1", "--width", "32", "--json", str(output)],
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    rows = json.loads(output.read_text())["results"]
    assert [(row["workers"], row["variant"]) for row in rows] == [
        (1, "keras"), (1, "hororing"), (2, "hororing ring"), (2, "hororing PS (1 server rank)"),
        (2, "hororing tape"), (2, "MultiWorkerMirrored"),
        (2, "ParameterServerStrategy (async, 1 ps)")]
    assert all(row["step_ms"] > 0 for row in rows)
    assert "| 2 | MultiWorkerMirrored |" in job.stdout
