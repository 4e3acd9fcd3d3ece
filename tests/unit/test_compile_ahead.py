"""``python -m hororing.algorithms.compiled``: the compiled steps made ahead into numba's disk
cache, in one process or several, and found there by the next process."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("numba")


def compile_ahead(cache, *args):
    environment = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "hororing.algorithms.compiled", *args],
                          capture_output=True, text=True, timeout=300, env=environment)


def counts(job):
    assert job.returncode == 0, job.stderr[-3000:]
    found = re.findall(r"(\d+) compiled, (\d+) loaded from the cache at (\S+)", job.stdout)
    return [(int(compiled), int(loaded), path) for compiled, loaded, path in found]


def test_steps_made_in_two_processes_are_loaded_from_the_cache_by_the_next(tmp_path):
    cache = tmp_path / "numba"
    made = compile_ahead(cache, "--dtypes", "int8,uint8", "--jobs", "2")
    # one process per dtype: each compiled its ring (writable and read-only input) and its
    # fold cycle, and the ring's request test (one signature for every dtype: one process
    # may find the other's in the cache), into the cache asked for
    found = counts(made)
    assert len(found) == 2 and sum(compiled + loaded for compiled, loaded, _ in found) == 8
    assert sum(compiled for compiled, _, _ in found) >= 7, made.stdout
    assert all(path.startswith(str(cache)) for _, _, path in found)
    for what in ("ring int8:", "ring uint8 (input read-only):", "fold cycle int8:"):
        assert what in made.stdout
    again = compile_ahead(cache, "--dtypes", "uint8,int8")
    assert [found[:2] for found in counts(again)] == [(0, 7)], again.stdout


def test_a_dtype_the_steps_do_not_take_is_named_with_those_they_do(tmp_path):
    for name in ("bool", "not-a-dtype"):
        job = compile_ahead(tmp_path, "--dtypes", f"float32,{name}")
        assert job.returncode != 0
        assert f"--dtypes: {name!r} is not a dtype the compiled steps take" in job.stderr
        assert "float32, float64, int16" in job.stderr
