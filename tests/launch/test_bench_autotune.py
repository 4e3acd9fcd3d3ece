"""scripts/bench_autotune.py end to end with a tiny model and short samples: a job started
from set values tunes from them, logs every setting, and times the grid beside the result."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import mpiexec

pytest.importorskip("torch")
pytest.importorskip("sklearn")
SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_autotune.py"


def test_bench_autotune_tunes_from_the_poor_start_and_times_the_grid(tmp_path):
    output = tmp_path / "autotune.json"
    env = dict(os.environ, HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="1",
               HOROVOD_AUTOTUNE_WARMUP_SAMPLES="1", HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES="4")
    job = subprocess.run([sys.executable, str(SCRIPT), "--mpiexec", mpiexec(), "--sizes", "3",
                          "--starts", "poor", "--widths", "64", "32", "10", "--batch-size", "8",
                          "--steps", "2", "--rounds", "1", "--json", str(output)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    (result,) = json.loads(output.read_text())["results"]
    assert result["size"] == 3 and result["start"] == "poor"
    rows = result["log_rows"]
    # the settings tried, the finalists (and the start unless among them) again, the best
    assert len(rows) - (4 + 1) in (3, 4)
    # the set values were where tuning started, not fixed
    assert (float(rows[0]["tensor_fusion_threshold"]), float(rows[0]["cycle_time_ms"])) == (1, 5)
    assert len({row["tensor_fusion_threshold"] for row in rows}) > 1
    assert len(result["step_ms"]) == 2 + 12 and all(ms > 0 for ms in result["step_ms"].values())
    assert "tuned / best hand-picked" in job.stdout
