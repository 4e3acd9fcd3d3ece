"""scripts/bench_training.py end to end with a few steps: it runs, and its variants agree."""

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import mpiexec

pytest.importorskip("torch")
pytest.importorskip("sklearn")
SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_training.py"


def test_bench_training_trains_the_same_parameters_as_its_peers(tmp_path):
    output = tmp_path / "training.json"
    job = subprocess.run([sys.executable, str(SCRIPT), "--mpiexec", mpiexec(), "--steps", "3",
                          "--rounds", "2", "--json", str(output)],
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-3000:]
    results = {result["size"]: result for result in json.loads(output.read_text())["results"]}
    assert sorted(results) == [1, 2]
    for size, peer in ((1, "torch"), (2, "ddp")):
        for model in results[size]["models"]:
            assert set(model["step_ms"]) == {"hororing", peer}
            assert all(value > 0 for value in model["step_ms"].values())
            # 10 warm-up + 6 timed steps of SGD from the same weights on the same batches
            assert model["max_param_diff"] < 1e-5, (size, model)
    for model in results[2]["models"]:
        assert model["timeline_steps"] == 20 and 0.0 <= model["hidden_fraction"] <= 1.0
    assert "| 2 | large |" in job.stdout
