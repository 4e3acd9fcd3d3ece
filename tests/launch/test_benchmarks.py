"""The benchmark scripts end to end on tiny sizes: they run, and every algorithm is correct.

Only the shape of the output is checked; timings are what the scripts are for, not the tests.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import mpiexec
from hororing.engine.negotiation import header_words

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def run_under_mpi(ranks, script, *args, timeout=300):
    """Run ``scripts/<script>`` on ``ranks`` ranks; fail with its stderr if it exits non-zero."""
    job = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPTS / script),
                          *args], capture_output=True, text=True, timeout=timeout, cwd=SCRIPTS)
    assert job.returncode == 0, job.stderr[-3000:]
    return job


ALLREDUCE_ALGORITHMS = ("ring", "outplace", "native", "plain", "flatout")


def test_bench_allreduce_runs_every_algorithm_correctly(tmp_path):
    output = tmp_path / "allreduce.json"
    run_under_mpi(3, "bench_allreduce.py", "--max-bytes", "1048576", "--seconds", "0.02",
                  "--rounds", "2", "--algorithms", *ALLREDUCE_ALGORITHMS, "--fusion", "--json",
                  str(output))
    report = json.loads(output.read_text())
    rows = report["rows"]
    assert {row["algorithm"] for row in rows} == set(ALLREDUCE_ALGORITHMS)
    assert {row["bytes"] for row in rows} >= {8, 1024 * 1024}
    assert all(row["wrong"] == 0 for row in rows), [row for row in rows if row["wrong"]]
    assert all(len(row["round_times_us"]) == 2 and row["time_us"] > 0 for row in rows)
    assert report["fusion"]["async_us"] > 0 and report["fusion"]["blocking_us"] > 0


def test_bench_ring_phases_times_each_phase_on_two_ranks_and_refuses_three():
    job = run_under_mpi(2, "bench_ring_phases.py", "--bytes", "65536", "--iterations", "20",
                        "--warmup", "2", "--json")
    report = json.loads(job.stdout.splitlines()[-1])
    assert report["bytes"] == 65536 and len(report["ranks"]) == 2
    for row in report["ranks"]:
        assert set(row) == {"send/recv", "add", "add again", "send back", "recv (oop)",
                            "add (oop)"}
        assert all(value > 0 for value in row.values())
    refused = subprocess.run([mpiexec(), "-n", "3", sys.executable,
                              str(SCRIPTS / "bench_ring_phases.py")], capture_output=True,
                             text=True, timeout=120, cwd=SCRIPTS)
    assert refused.returncode != 0 and "exactly 2 ranks" in refused.stderr


def test_bench_small_between_work_times_every_kind_of_work(tmp_path):
    output = tmp_path / "between.json"
    # a wrong sum exits non-zero
    run_under_mpi(2, "bench_small_between_work.py", "--calls", "20", "--rounds", "2",
                  "--json", str(output))
    rows = json.loads(output.read_text())["rows"]
    assert [row["work"] for row in rows] == ["back-to-back", "compute", "mpi", "sleep"]
    assert all(row["hororing_us"] > 0 and row["mpi_us"] > 0 for row in rows)


def test_bench_ring_vs_ps_fits_the_model_and_checks_every_algorithm(tmp_path):
    output = tmp_path / "ring_vs_ps.json"
    job = subprocess.run([sys.executable, str(SCRIPTS / "bench_ring_vs_ps.py"),
                          "--mpiexec", mpiexec(), "--ns", "2,3", "--servers", "2",
                          "--sizes", "4096,65536,262144", "--size-n", "3", "--fit-from", "0",
                          "--seconds", "0.02", "--blocks", "2", "--json", str(output)],
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    report = json.loads(output.read_text())
    rows = report["rows"]
    assert {(row["algorithm"], row["n"]) for row in rows} == {
        (algorithm, n) for algorithm in ("ring", "colocated", "native", "ps1", "ps2")
        for n in (2, 3)}
    assert all(row["wrong"] == 0 for row in rows), [row for row in rows if row["wrong"]]
    assert all(row["blocks"] == 2 and row["time_s"] <= row["median_s"] for row in rows)
    fit = report["fit"]
    assert min(fit["alpha"], fit["beta"], fit["gamma"]) >= 0
    assert len(fit["ratios"]) == 12  # ring and ps1, 3 sizes, 2 worker counts
    assert all(row["model_s"] > 0 for row in rows if row["algorithm"] in ("ring", "ps1"))
    assert "(b) n sweep at 4 MiB" in job.stdout


def test_bench_gpu_runs_every_part_in_the_cuda_simulator(tmp_path):
    pytest.importorskip("numba")
    output = tmp_path / "gpu.json"
    environment = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    job = subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu.py"), "--backend", "numba",
                          "--sizes", "4096", "--tensors", "5", "--tensor-bytes", "256",
                          "--ring-bytes", "65536,4100", "--rounds", "2", "--seconds", "0.02",
                          "--transports", "auto", "staged",
                          "--mpiexec", mpiexec(), "--json", str(output)],
                         capture_output=True, text=True, timeout=300, cwd=SCRIPTS, env=environment)
    assert job.returncode == 0, job.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["simulator"] and "timings meaningless" in job.stdout
    rows = report["reduce"] + report["fp16"] + [report["pack"]] + report["ring"]
    assert all(row["wrong"] == 0 for row in rows), rows
    assert report["pack"]["tensors"] == 5
    # numba (the simulator) cannot share device memory: auto stages too
    assert [(row["transport"], row["bytes"]) for row in report["ring"]] == \
        [("staged", 65536), ("staged", 4100)] * 2
    assert all(row["ranks"] == 2 and row["device_s"] > 0 for row in report["ring"])


def test_bench_negotiation_shows_a_fixed_size_vote_and_a_correct_allreduce(tmp_path):
    output = tmp_path / "negotiation.jsonl"
    run_under_mpi(3, "bench_negotiation.py", "--seconds", "0.01", "--rounds", "2",
                  "--json", str(output))
    report = json.loads(output.read_text())
    rows = {row["case"]: row for row in report["rows"]}
    assert set(rows) == {"barrier", "allreduce", "gather", "vote"}
    vote_bytes = 8 * (1 + (report["capacity"] + 63) // 64)
    # a cached barrier is one vote per cycle, whatever the ranks; nothing is gathered
    assert rows["barrier"]["bytes_per_cycle"] == vote_bytes
    assert rows["barrier"]["gather_cycles"] == 0
    assert rows["vote"]["bytes_per_cycle"] == vote_bytes
    header_bytes = 8 * header_words(report["capacity"])
    assert rows["gather"]["bytes_per_cycle"] == 3 * header_bytes  # a header row per rank
    assert rows["allreduce"]["wrong"] == 0


def test_bench_tuning_sweeps_every_setting_with_correct_results(tmp_path):
    output = tmp_path / "tuning.json"
    job = run_under_mpi(3, "bench_tuning.py", "--seconds", "0.01", "--rounds", "2", "--json",
                        str(output), timeout=600)
    report = json.loads(output.read_text())
    assert set(report) >= {"subchunk", "small", "waits", "poll"}
    for setting in ("subchunk", "small"):
        assert all(row["wrong"] == 0 for row in report[setting]), report[setting]
    assert [row["wrong"] for row in report["waits"][:2]] == [0, 0]  # 4 KiB, 1 MiB
    assert {"256K", "1M*", "2M", "4M", "plain"} <= set(report["subchunk"][0])
    assert [row["bytes"] for row in report["small"]][-1] == 1024 * 1024
    waits = report["waits"]
    assert len(waits) == 3 and all(value > 0 for key, value in waits[0].items() if key != "wrong")
    assert waits[2]["bytes"] == "late 50 ms" and waits[2]["default* cpu"] > 0
    poll = report["poll"]
    assert [row["skew_us"] for row in poll[:-1]] == [0, 100, 1000, 3000, 10000]
    assert all(poll[0][label] > 0 for label in ("native", "500/5000*"))
    # the automatic small-message threshold at 3 ranks: 1 MiB // 3
    assert f"the automatic threshold at 3 ranks: {(1 << 20) // 3} B" in job.stdout


def test_bench_call_phases_splits_a_call_into_phases_that_add_up():
    job = run_under_mpi(3, "bench_call_phases.py", "--sizes", "4KiB,4MiB", "--calls", "5")
    rows = [line.split() for line in job.stdout.splitlines()
            if line.split() and line.split()[0] in ("4KiB", "4MiB")]
    assert [row[0] for row in rows] == ["4KiB", "4MiB"], job.stdout
    for row in rows:
        phases, total = [float(cell) for cell in row[1:8]], float(row[8])
        assert all(value >= 0 for value in phases) and total > 0
        # the medians of the phases need not add up to the median total; their scale does
        assert sum(phases) < 3 * total
    # 4 MiB takes the ring and never folds (on one node the fold takes below 4 MiB): the
    # algorithm phase is timed
    assert float(rows[1][5]) > 0


def test_bench_scale_times_every_algorithm_and_the_model_fits_and_predicts(tmp_path):
    """bench_scale on 3 ranks (every result checked), then simulate_scale calibrating on its
    output and predicting from the fit the engine uses."""
    output = tmp_path / "scale.json"
    run_under_mpi(3, "bench_scale.py", "--max-bytes", "65536", "--rounds", "2",
                  "--seconds", "0.01", "--shared-segments", "16384", "--json", str(output))
    report = json.loads(output.read_text())
    assert [row["bytes"] for row in report["rows"]] == [4096, 16384, 65536]
    assert all(row["wrong"] == 0 for row in report["rows"])
    # the 3 ranks share this machine: the allreduce through its shared memory is timed too,
    # also with 16 KiB segments (several a buffer from 64 KiB: its result checked as well)
    assert set(report["rows"][0]["time_us"]) == {"ring", "rabenseifner", "recursive_doubling",
                                                 "small", "shared", "shared_16KiB", "mpi",
                                                 "library", "library_ring",
                                                 "library_ring_again", "library_shared"}
    fit = tmp_path / "fit.json"
    calibrated = subprocess.run([sys.executable, str(SCRIPTS / "simulate_scale.py"),
                                 "--calibrate", str(output), str(output), "--fit", str(fit)],
                                capture_output=True, text=True, timeout=300)
    assert calibrated.returncode == 0, calibrated.stderr[-3000:]
    assert "worst measured/predicted" in calibrated.stdout
    assert set(json.loads(fit.read_text())["factors"]) == {"step", "piece", "call",
                                                           "mpi_step", "reduce"}
    # oversubscription is judged against the cores of the machine the run was measured on
    assert json.loads(fit.read_text())["cores"] == report["machine"]["cores"]
    docs_fit = SCRIPTS.parent / "docs" / "results" / "scale_fit.json"
    predicted = subprocess.run([sys.executable, str(SCRIPTS / "simulate_scale.py"),
                                "--fit", str(docs_fit)], capture_output=True, text=True,
                               timeout=300)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert "| 4096 | " in predicted.stdout and "targets at 64-4096 ranks" in predicted.stdout


def test_scale_checks_runs_each_rank_count_the_cores_allow_and_calibrates(tmp_path):
    """scripts/scale_checks.sh at 2 ranks and at more ranks than any machine here has cores:
    the first is measured and calibrated on, the second skipped, saying so."""
    environment = dict(os.environ, PATH=os.pathsep.join(
        [os.path.dirname(sys.executable), os.path.dirname(mpiexec()), os.environ["PATH"]]))
    job = subprocess.run(["bash", str(SCRIPTS / "scale_checks.sh"), str(tmp_path), "2", "4096"],
                         capture_output=True, text=True, timeout=600, env=environment)
    assert job.returncode == 0, job.stderr[-3000:]
    log = (tmp_path / "scale_checks.log").read_text()
    assert "4096 ranks: more than this machine's" in log
    report = json.loads((tmp_path / "scale_shm_2.json").read_text())
    assert report["ranks"] == 2 and all(row["wrong"] == 0 for row in report["rows"])
    validation = json.loads((tmp_path / "scale_validation.json").read_text())
    assert validation and "worst measured/predicted" in log


def test_call_cost_checks_runs_the_rank_counts_the_cores_allow(tmp_path):
    """scripts/call_cost_checks.sh with few calls: its 2-rank tables, each rank count above
    this machine's cores skipped, saying so, and no step failed."""
    environment = dict(os.environ, CALLS="20", WARMUP="5", PATH=os.pathsep.join(
        [os.path.dirname(sys.executable), os.path.dirname(mpiexec()), os.environ["PATH"]]))
    job = subprocess.run(["bash", str(SCRIPTS / "call_cost_checks.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=environment)
    assert job.returncode == 0, job.stderr[-3000:]
    log = (tmp_path / "call_cost_checks.log").read_text()
    for api in ("numpy", "numpy-out", "torch"):
        assert f"# 2 ranks, the {api} API" in log, log[-3000:]
    assert "exit " not in log and "WRONG" not in log, log[-3000:]
    cores = os.cpu_count()
    for ranks in (8, 16):
        assert (f"skipped {ranks} ranks: fewer cores" in log) == (ranks > cores), log[-3000:]


def test_bench_compression_refuses_an_unknown_variant_naming_the_variants():
    job = subprocess.run([sys.executable, str(SCRIPTS / "bench_compression.py"), "--variants",
                          "hororing:fp16"], capture_output=True, text=True, timeout=120)
    assert job.returncode == 2
    assert "unknown variant(s) 'hororing:fp16'; the variants are 'hororing none'" in job.stderr


def test_bench_compression_times_every_variant_on_the_small_model(tmp_path):
    output = tmp_path / "compression.json"
    run_under_mpi(2, "bench_compression.py", "--models", "train", "--rounds", "1", "--steps",
                  "1", "--json", str(output), timeout=600)
    rows = json.loads(output.read_text())["models"]["train"]
    timed = {row["variant"] for row in rows if row["error"] is None}
    assert {"hororing none", "hororing fp16", "hororing bf16", "hororing powersgd1",
            "hororing powersgd4", "ddp allreduce", "ddp fp16", "alone"} <= timed
    sent = {row["variant"]: row["sent_mb"] for row in rows if row["error"] is None}
    assert sent["alone"] < 0.1 * sent["ddp allreduce"]  # reduces nothing
    assert all(row["step_ms"] > 0 and row["cpu_ms"] > 0 for row in rows if row["error"] is None)


def test_bench_step_phases_times_each_part_of_a_step_for_both_libraries():
    job = run_under_mpi(3, "bench_step_phases.py", "--model", "train", "--steps", "2",
                        timeout=300)
    lines = job.stdout.splitlines()
    for library in ("hororing", "ddp"):
        steps = [line for line in lines if line.startswith(f"{library} step ")]
        assert len(steps) == 2, job.stdout
        for line in steps:
            parts = dict(re.findall(r"(fwd|bwd|sync|sgd|slowest) (\d+)", line))
            assert int(parts["fwd"]) <= int(parts["bwd"]) <= int(parts["sync"]), line
            assert line.count(":") == 1 + 6, line  # the step's and one per parameter
    cycles = [line for line in lines if line.strip().startswith("cycles ")]
    assert len(cycles) == 2 and all("r1]" in line for line in cycles), job.stdout


@pytest.mark.parametrize("api, op, tensors, shrink, cpu", [("numpy", "sum", "1", "1", True),
                                                           ("torch", "average", "3", "16", False)])
def test_bench_call_cost_times_both_sides_and_counts_the_calls(api, op, tensors, shrink, cpu):
    if api == "torch":
        pytest.importorskip("torch")
    job = run_under_mpi(3, "bench_call_cost.py", "--sizes", "4KiB,24KiB", "--calls", "20",
                        "--warmup", "5", "--api", api, "--op", op, "--tensors", tensors,
                        "--shrink", shrink, *(["--cpu"] if cpu else []))
    rows = [line.split() for line in job.stdout.splitlines()
            if line.strip() and not line.startswith("#") and not line.lstrip().startswith("bytes")]
    assert [row[0] for row in rows] == ["4096", "24576"] and "WRONG" not in job.stdout
    assert (f"{tensors} tensors in turn" in job.stdout) == (tensors != "1")
    assert (f"each 1/{shrink} of the one before" in job.stdout) == (shrink != "1")
    assert ("hororing CPU us" in job.stdout) == cpu
    for row in rows:
        # the Python calls: tests/mpi/test_call_budget.py holds their budget; here, that
        # the count counts (at least the door, the lane and the wait)
        assert float(row[1]) > 0 and float(row[2]) > 0 and 6 <= float(row[4]) < 1000
        assert len(row) == (9 if cpu else 5)
        if cpu:  # each side's CPU of the 3 ranks, and the cores: that CPU over its time
            for time_us, cpu_us, cores in ((row[1], row[5], row[6]), (row[2], row[7], row[8])):
                assert float(cpu_us) > 0
                assert float(cores) == pytest.approx(float(cpu_us) / float(time_us), abs=0.02)


def test_bench_fold_rows_times_both_exchanges_and_their_sums_are_right():
    job = run_under_mpi(3, "bench_fold_rows.py", "--sizes", "4KiB,24KiB", "--calls", "10")
    rows = [line.split() for line in job.stdout.splitlines()
            if line.strip() and not line.startswith("#") and not line.lstrip().startswith("bytes")]
    assert [row[0] for row in rows] == ["4096", "24576"] and "WRONG" not in job.stdout
    for row in rows:
        assert all(float(value) > 0 for value in row[1:6])


def test_bench_ring_steps_times_every_algorithm_with_the_models_prediction():
    pytest.importorskip("numba")
    job = run_under_mpi(3, "bench_ring_steps.py", "--sizes", "4KiB,300KiB", "--calls", "4",
                        "--warmup", "1")
    rows = [line.split() for line in job.stdout.splitlines()
            if line.strip() and not line.startswith("#") and not line.lstrip().startswith("bytes")]
    assert [row[0] for row in rows] == ["4096", "307200"], job.stdout
    assert "-" in rows[1] and "-" not in rows[0]  # the gathered path only up to 256 KiB
    assert "the ring ran compiled: True, Python: True" in job.stdout


def test_bench_ddp_backend_times_ddp_over_both_backends_and_they_agree(tmp_path):
    output = tmp_path / "ddp.json"
    run_under_mpi(3, "bench_ddp_backend.py", "--models", "small", "--rounds", "1", "--steps",
                  "1", "--json", str(output), timeout=600)
    rows = {row["variant"]: row for row in json.loads(output.read_text())["rows"]}
    assert set(rows) == {f"{backend} {hook}" for backend in ("hororing", "gloo")
                         for hook in ("none", "fp16", "powersgd4")} | {"alone none"}
    assert all(row["step_ms"] > 0 for row in rows.values())
    # the same training over either backend: the same parameters, up to the order of sums
    assert rows["hororing none"]["max_param_diff"] < 1e-5
    assert rows["hororing fp16"]["max_param_diff"] < 1e-3


def test_bench_checkpoint_times_each_way_to_save_and_writes_one_file_per_rank(tmp_path):
    job = run_under_mpi(3, "bench_checkpoint.py", "--params", "2e6", "--width", "256",
                        "--quiet-steps", "1", "--dir", str(tmp_path / "ckpt"), "--json",
                        timeout=300)
    report = json.loads(job.stdout.strip().splitlines()[-1])
    assert [row["what"] for row in report["rows"]] == ["gather", "save", "async1", "async",
                                                       "load"]
    assert all(row["seconds"] > 0 and len(row["peak_added_mb_per_rank"]) == 3
               for row in report["rows"])
    assert report["steps_during_async"] and report["quiet_step"] > 0
    # one round: one first step after the call, and both comparisons made from the steps
    assert len(report["first_steps"]) == 1
    assert report["first_steps"][0] in report["steps_during_async"]
    assert report["during_over_quiet"]["median"] > 0 and report["during_over_quiet"]["p90"] > 0
    names = [name for name, _ in report["files"]]
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


def test_bench_local_sgd_trains_every_variant_and_counts_its_bytes(tmp_path):
    output = tmp_path / "local.json"
    run_under_mpi(2, "bench_local_sgd.py", "--steps", "4", "--sync-every", "2", "--eval-every",
                  "2", "--batch", "8", "--json", str(output), timeout=300)
    report = json.loads(output.read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert set(rows) == {"sync", "ddp-gloo", "localsgd", "diloco", "diloco-fp16",
                         "diloco-int8", "diloco-frag4", "diloco-stream"}
    for row in rows.values():
        assert [step for step, _ in row["curve"]] == [2, 4]
        assert row["seconds"] > 0 and row["final_loss"] > 0
    # the same start, the same batches: synchronous training over either library agrees
    assert abs(rows["sync"]["final_loss"] - rows["ddp-gloo"]["final_loss"]) < \
        1e-4 * rows["sync"]["final_loss"]
    assert rows["ddp-gloo"]["sent_bytes"] > 0  # gloo's bytes cross the loopback


def test_bench_optimizer_calls_counts_every_variant_and_checks_the_parameters():
    pytest.importorskip("torch")
    job = run_under_mpi(3, "bench_optimizer_calls.py", "--steps", "3", "--warmup", "1")
    rows = [line.split() for line in job.stdout.splitlines()
            if line.strip() and not line.startswith("#") and not line.lstrip().startswith("variant")]
    assert [row[0] for row in rows] == ["plain", "sharded1", "sharded2", "numpy"], job.stdout
    for variant, calls, wing, milliseconds, equal in rows:
        assert 0 < int(wing) <= int(calls) and float(milliseconds) > 0 and equal == "True"


def run_chaos(mode, *args):
    """bench_chaos.py on a short job: ranks are killed, and the run must lose nothing."""
    job = subprocess.run([sys.executable, str(SCRIPTS / "bench_chaos.py"), "--modes", mode,
                          "--steps", "120", "--step-ms", "20", "--commit-every", "5",
                          "--every", "1", "--max-faults", "2", "--timeout", "300", *args],
                         capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    row = [line for line in job.stdout.splitlines()  # the main table's (12 cells), not the
           if line.startswith(f"| {mode} |") and line.count("|") == 13]  # relaunches' split
    assert len(row) == 1, job.stdout
    cells = [cell.strip() for cell in row[0].strip("|").split("|")]
    assert cells[-1] == "all steps, equal parameters, commits intact", row[0]
    assert int(cells[1].split()[0]) >= 1, row[0]  # faults that were injected
    return cells


def test_bench_chaos_relaunches_killed_ranks_and_loses_nothing():
    cells = run_chaos("relaunch-mpich", "--ranks", "2")
    assert int(cells[8]) >= 1  # relaunches
