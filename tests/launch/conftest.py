"""Helpers to launch a whole job under mpiexec with a hard timeout."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from hororing.runner import leftovers

JOBS = pathlib.Path(__file__).parent / "jobs"


def find_mpiexec():
    """The mpiexec beside this Python, else the one on PATH; None where there is none."""
    beside_python = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


def mpiexec():
    found = find_mpiexec()
    if found is None:
        pytest.skip("no mpiexec: pip install 'hororing[mpi]' or install an MPI")
    return found


@pytest.fixture(scope="session")
def session_began():
    began = time.time()
    yield began
    leftovers.remove_left_behind(began, wait=True)  # what the last test's ranks left


@pytest.fixture(autouse=True)
def no_shared_memory_left(session_began):
    """Jobs these tests kill leave their MPI shared memory in /dev/shm (killed ranks never
    unlink it; hororun removes its own launches'): removed after each test, as hororun does,
    so a long run does not fill a small /dev/shm."""
    yield
    leftovers.remove_left_behind(session_began)


@pytest.fixture
def launch():
    def run(ranks, job, *args, env=None, timeout=120):
        environment = dict(os.environ)
        environment.update(env or {})
        command = [mpiexec(), "-n", str(ranks), sys.executable, str(JOBS / job), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                               env=environment)
    return run


EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def run_example(script, ranks, *args, timeout=300, env=None):
    """Run ``examples/<script>`` on ``ranks`` ranks under mpiexec; return the finished job."""
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(EXAMPLES / script),
                           *args], capture_output=True, text=True, timeout=timeout,
                          env=environment)


def reported_accuracy(job):
    """The test accuracy an example printed, once it has exited cleanly."""
    assert job.returncode == 0, job.stderr[-3000:]
    return float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1))


# The whole-job launches that only the full run takes (``bash tests/run.sh --full``): each is a
# second rank count, a second flavour or a longer variant of a launch the quick run keeps (named
# after the #), or a benchmark's smoke run. The quick run (CI) keeps one of each capability.
FULL_ONLY = {
    "test_examples.py::test_training_reaches_95_percent[1]",  # [3] kept
    "test_examples.py::test_sharded_files_example_runs_one_file_per_rank_at_16_ranks",  # per-rank channels kept
    "test_examples.py::test_asynchronous_ps_training_converges_on_digits",  # PS mode kept
    "test_examples.py::test_training_across_two_simulated_nodes_finishes_without_transport_warnings",  # emulated hosts in run.sh
    "test_examples.py::test_resume_continues_from_the_checkpoint",  # elastic commits kept
    "test_elastic.py::test_a_rank_killed_at_a_random_step_costs_only_the_work_since_the_last_commit[1]",  # [0] kept
    "test_elastic.py::test_a_rank_killed_at_a_random_step_costs_only_the_work_since_the_last_commit[2]",
    "test_elastic.py::test_a_keras_fit_killed_mid_epoch_resumes_with_its_optimizer_state[tf_keras]",  # keras3 kept
    "test_elastic.py::test_a_job_that_fails_before_every_commit_is_not_relaunched_forever",  # reset limit kept
    "test_elastic.py::test_more_slots_discovered_grow_the_job_up_to_max_np[off]",  # [auto] kept
    "test_elastic.py::test_a_launch_ahead_that_never_gets_ready_is_ended_and_the_job_grows_by_a_relaunch",  # the driver's deadline in tests/unit
    "test_elastic.py::test_a_kill_in_the_middle_of_writing_a_commit_leaves_the_previous_one",
    "test_slurm.py::test_sbatch_job_trains_and_its_log_has_no_progress_bar_updates[1-hororun]",  # 2 nodes kept
    "test_slurm.py::test_hororun_inside_salloc_takes_the_allocations_tasks_and_nodes[1]",  # 2 nodes kept
    "test_tf_keras.py::test_tf_keras_gradient_paths_aggregation_and_local_variables[3]",  # [1] kept
    "test_tf_keras.py::test_tf_keras_broadcast_callback_makes_every_rank_train_rank_zeros_model[3-eager]",  # 2 ranks kept
    "test_tf_keras.py::test_tf_keras_broadcast_callback_makes_every_rank_train_rank_zeros_model[3-graph]",
    "test_tf_keras.py::test_tf_keras_fit_equals_large_batch_training[1]",  # [2] kept
    "test_tf_keras.py::test_tf_keras_fit_equals_large_batch_training[3]",
    "test_bench_training.py::test_bench_training_trains_the_same_parameters_as_its_peers",
    "test_keras_example.py::test_keras_training_reaches_95_percent[1]",  # [2] kept
    "test_keras_example.py::test_keras_training_reaches_95_percent[3]",
    "test_keras_example.py::test_keras_ps_mode_gives_the_ring_result",  # PS mode kept (torch)
    "test_tf1_example.py::test_tf1_ps_mode_gives_the_ring_result",
    "test_tf1_example.py::test_tf1_ps_mode_aggregates_the_first_replicas",
    "test_tf1_example.py::test_tf1_graph_training_reaches_95_percent[1]",  # [2] kept
    "test_tf1_example.py::test_tf1_graph_training_reaches_95_percent[3]",
    "test_bench_keras.py::test_bench_keras_reports_every_variant",
    "test_checkpoint_sizes.py::test_a_local_sgd_or_diloco_checkpoint_of_3_ranks_resumes_at_2_and_4[LocalSGD]",  # [DiLoCo] kept
    # a real torn save kept (over a complete one); the refusal with nothing complete in tests/mpi
    "test_checkpoint_sizes.py::test_a_save_a_rank_died_in_is_never_loaded",
    "test_benchmarks.py::test_bench_tuning_sweeps_every_setting_with_correct_results",
    "test_bench_autotune.py::test_bench_autotune_tunes_from_the_poor_start_and_times_the_grid",
    "test_mpi_operator.py::test_training_in_the_mpijob_reaches_the_accuracy_of_a_local_run[mpirun]",  # [hororun] kept
    "test_mpi_operator.py::test_training_in_the_mpijob_reaches_the_accuracy_of_a_local_run[hororun-other-format]",
    "test_scale_algorithms.py::test_the_default_follows_the_model_and_every_rank_agrees_bitwise[11-off-0]",  # [6-*] kept
    "test_examples.py::test_ps_mode_trains_to_the_same_parameters_as_the_ring",  # test_ps.py kept
    "test_examples.py::test_sharded_stage_2_example_trains_to_the_same_parameters",  # stage 1 kept
    "test_elastic.py::test_a_sharded_optimizer_state_is_laid_out_again_when_the_job_changes_size[grow]",  # [shrink] kept
    # in-process recovery (the Open MPI stage): a kill, two deaths, growth, the chaos smoke kept
    "test_ulfm.py::test_the_survivors_of_a_killed_rank_go_on_in_process[1]",
    "test_ulfm.py::test_a_job_shrunk_to_one_rank_trains_on_alone",
    "test_ulfm.py::test_too_few_survivors_for_min_np_relaunch_the_job_from_its_commit",
    "test_ulfm.py::test_a_sharded_optimizer_cannot_go_on_in_process_and_is_relaunched",
    "test_benchmarks.py::test_bench_compression_times_every_variant_on_the_small_model",
    "test_benchmarks.py::test_call_cost_checks_runs_the_rank_counts_the_cores_allow",  # its benchmarks kept
    "test_benchmarks.py::test_bench_step_phases_times_each_part_of_a_step_for_both_libraries",
    "test_benchmarks.py::test_bench_chaos_relaunches_killed_ranks_and_loses_nothing",  # test_elastic's kill kept
    "test_bench_sharded.py::test_bench_sharded_memory_holds_a_third_of_the_state_at_three_ranks",  # variants kept
}
# Launches the quick run takes under Open MPI only (the Open MPI stage of tests/run.sh): under
# MPICH they are full-only. The MPI Operator's image runs Open MPI, so its launches run there.
OPEN_MPI_ONLY = {
    "test_mpi_operator.py::test_training_in_the_mpijob_reaches_the_accuracy_of_a_local_run[hororun]",
    "test_mpi_operator.py::test_elastic_hororun_follows_discover_hosts_as_a_worker_goes_and_comes_back",
}


def pytest_collection_modifyitems(config, items):
    from hororing.runner.mpiexec import OPEN_MPI, mpi_flavor
    found = find_mpiexec()
    open_mpi = found is not None and mpi_flavor(found) == OPEN_MPI
    full_only = FULL_ONLY if open_mpi else FULL_ONLY | OPEN_MPI_ONLY
    collected = set()
    for item in items:
        nodeid = item.nodeid.split("tests/launch/", 1)[-1]
        collected.add(nodeid)
        if nodeid in full_only:
            item.add_marker(pytest.mark.full)
    if not any("::" in arg for arg in config.args):
        stale = unmatched(FULL_ONLY | OPEN_MPI_ONLY, collected)
        if stale:
            raise pytest.UsageError(
                "tests/launch/conftest.py names launches no test has (renamed, or their "
                "parameters changed): " + ", ".join(stale) + "; name them as pytest "
                "--collect-only lists them")


def unmatched(entries, collected):
    """The entries that name a test of a collected file but match none of its tests."""
    files = {nodeid.split("::", 1)[0] for nodeid in collected}
    return sorted(entry for entry in entries
                  if entry.split("::", 1)[0] in files and entry not in collected)


def pytest_configure(config):
    config.addinivalue_line("markers", "full: a launch only the full run takes "
                                       "(bash tests/run.sh --full); CI runs -m 'not full'")
