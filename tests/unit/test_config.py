"""Settings come from Horovod's and hororing's environment variables, validated."""

import pytest

from hororing.config import Config

READERS = ("config.py", "environment.py")  # the modules that read the environment


def test_defaults():
    config = Config.from_environ({})
    assert config.fusion_threshold == 64 * 1024 * 1024
    assert config.stall_check_seconds == 60.0
    assert config.timeline_path == ""


def test_horovod_names_and_hororing_precedence():
    config = Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "3.5",
                                  "HOROVOD_TIMELINE": "/tmp/t.json",
                                  "HOROVOD_STALL_CHECK_DISABLE": "1"})
    assert (config.fusion_threshold, config.cycle_time_ms) == (1024, 3.5)
    assert config.timeline_path == "/tmp/t.json" and not config.stall_check_enabled
    both = Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "1", "HORORING_FUSION_THRESHOLD": "2"})
    assert both.fusion_threshold == 2


def test_overrides_beat_environment():
    config = Config.from_environ({"HOROVOD_CYCLE_TIME": "5"}, cycle_time_ms=0.5)
    assert config.cycle_time_ms == 0.5


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="HORORING_FUSION_THRESHOLD .* invalid value 'lots'"):
        Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "lots"})
    with pytest.raises(ValueError, match="fusion threshold must be >= 0 bytes, got -1"):
        Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "-1"})
    with pytest.raises(ValueError, match="ring sub-chunk must be > 0 bytes, got 0"):
        Config.from_environ({"HORORING_RING_SUBCHUNK_BYTES": "0"})


def test_ps_settings_from_the_environment():
    config = Config.from_environ({"HORORING_MODE": "PS", "HORORING_PS_SERVERS": "colocated",
                                  "HORORING_PS_PLACEMENT": "partitioned",
                                  "HORORING_PS_REPLICAS_TO_AGGREGATE": "3"})
    assert (config.mode, config.ps_servers, config.ps_placement, config.ps_replicas) == (
        "ps", 0, "partitioned", 3)
    assert Config.from_environ({"HORORING_PS_SERVERS": "2"}).ps_servers == 2


@pytest.mark.parametrize("environ,message", [
    ({"HORORING_MODE": "allreduce"}, r"mode must be one of \('ring', 'ps'\)"),
    ({"HORORING_PS_SERVERS": "-1"}, "number of PS servers must be >= 0"),
    ({"HORORING_PS_SERVERS": "many"}, "HORORING_PS_SERVERS .* invalid value 'many'"),
    ({"HORORING_PS_PLACEMENT": "random"}, "PS placement must be one of"),
    ({"HORORING_PS_REPLICAS_TO_AGGREGATE": "-2"}, "replicas_to_aggregate must be >= 1"),
])
def test_bad_ps_settings_are_named(environ, message):
    with pytest.raises(ValueError, match=message):
        Config.from_environ(environ)


def test_hierarchical_allreduce_switch_and_threshold():
    defaults = Config.from_environ({})
    # automatic across nodes, but with no threshold it never chooses the hierarchical path
    assert defaults.hierarchical_allreduce is None and defaults.hierarchical_threshold_bytes is None
    assert Config.from_environ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}).hierarchical_allreduce is True
    assert Config.from_environ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}).hierarchical_allreduce is False
    config = Config.from_environ({"HORORING_HIERARCHICAL_THRESHOLD_BYTES": "4096"})
    assert config.hierarchical_threshold_bytes == 4096
    with pytest.raises(ValueError, match="hierarchical threshold must be >= 0 bytes, got -1"):
        Config.from_environ({"HORORING_HIERARCHICAL_THRESHOLD_BYTES": "-1"})
    with pytest.raises(ValueError, match="HORORING_HIERARCHICAL_ALLREDUCE .* invalid value 'maybe'"):
        Config.from_environ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "maybe"})


def test_gpu_selection_switch():
    assert Config.from_environ({}).select_device is True
    assert Config.from_environ({"HORORING_SELECT_DEVICE": "0"}).select_device is False


def test_tuning_settings_from_the_environment():
    config = Config.from_environ({
        "HORORING_WAIT_SPIN_TESTS": "0", "HORORING_WAIT_YIELD_TESTS": "10",
        "HORORING_WAIT_MAX_SLEEP_US": "250", "HORORING_POLL_ACTIVE_US": "100",
        "HORORING_POLL_IDLE_US": "2000", "HORORING_STAGED_COPY_BYTES": "4096"})
    assert (config.wait_spin_tests, config.wait_yield_tests, config.wait_max_sleep_us) == (
        0, 10, 250.0)
    assert (config.poll_active_us, config.poll_idle_us) == (100.0, 2000.0)
    assert config.staged_copy_bytes == 4096


def test_waits_barely_spin_where_a_node_runs_more_ranks_than_cores_unless_the_spin_is_set():
    default = Config.from_environ({})
    assert default.spin_tests(ranks_on_node=2, cores=2) == default.wait_spin_tests == 50
    assert default.spin_tests(ranks_on_node=3, cores=2) == 1
    assert default.spin_tests(ranks_on_node=16, cores=2) == 1
    assert Config.from_environ({"HORORING_WAIT_SPIN_TESTS": "50"}).spin_tests(16, 2) == 50
    assert Config.from_environ({}, wait_spin_tests=7).spin_tests(16, 2) == 7


def test_comm_hook_buckets_are_capped_by_their_own_size_and_the_fusion_threshold():
    from hororing.engine.allreduce import Route

    def route(environ):
        return Route.configured(Config.from_environ(environ), 2, across_nodes=False)
    assert Config.from_environ({}).hook_bucket_bytes == 16 * 1024 * 1024
    default = route({})
    assert default.bucket_bytes() == 64 * 1024 * 1024  # no hook: the fusion threshold
    assert default.bucket_bytes(hooked=True) == 16 * 1024 * 1024
    assert route({"HORORING_HOOK_BUCKET_BYTES": "0"}).bucket_bytes(hooked=True) == 64 << 20
    small_fusion = route({"HOROVOD_FUSION_THRESHOLD": str(4 << 20)})
    assert small_fusion.bucket_bytes(hooked=True) == 4 << 20
    # the autotuner replaces the route: the cap stays
    assert default._replace(fusion_threshold=8 << 20).bucket_bytes(hooked=True) == 8 << 20


@pytest.mark.parametrize("environ,message", [
    ({"HORORING_WAIT_SPIN_TESTS": "-1"},
     r"wait_spin_tests must be >= 0 \(HORORING_WAIT_SPIN_TESTS\)"),
    ({"HORORING_POLL_IDLE_US": "-5"},
     r"poll_idle_us must be >= 0 \(HORORING_POLL_IDLE_US\)"),
    ({"HORORING_WAIT_SPIN_TESTS": "100", "HORORING_WAIT_YIELD_TESTS": "10"},
     r"wait_yield_tests \(10\) must be >= wait_spin_tests \(100\)"),
    ({"HORORING_STAGED_COPY_BYTES": "0"}, "staged copy size must be > 0 bytes"),
    ({"HORORING_HOOK_BUCKET_BYTES": "-1"},
     r"comm hook bucket size must be >= 0 bytes \(HORORING_HOOK_BUCKET_BYTES"),
    ({"HORORING_POLL_ACTIVE_US": "fast"},
     "HORORING_POLL_ACTIVE_US .* invalid value 'fast'"),
])
def test_bad_tuning_settings_are_named(environ, message):
    with pytest.raises(ValueError, match=message):
        Config.from_environ(environ)


def test_small_message_threshold_follows_the_ranks_unless_fixed():
    automatic = Config.from_environ({})
    assert [automatic.small_threshold(n) for n in (1, 2, 3, 16)] == [1048576, 524288, 349525, 65536]
    fixed = Config.from_environ({"HORORING_SMALL_ALLREDUCE_BYTES": "4096"})
    assert fixed.small_threshold(2) == fixed.small_threshold(64) == 4096
    total = Config.from_environ({"HORORING_SMALL_ALLREDUCE_TOTAL_BYTES": "65536"})
    assert total.small_threshold(4) == 16384
    # across nodes the gathered rows cross the links: a smaller total, unless one is set
    assert automatic.small_threshold(4, across_nodes=True) == 65536
    assert automatic.small_threshold(4, across_nodes=False) == 262144
    given = Config.from_environ({"HORORING_SMALL_ALLREDUCE_TOTAL_BYTES": "4194304"})
    assert given.small_threshold(4, across_nodes=True) == 1048576
    assert fixed.small_threshold(4, across_nodes=True) == 4096
    with pytest.raises(ValueError, match="small allreduce total must be >= 0 bytes"):
        Config.from_environ({"HORORING_SMALL_ALLREDUCE_TOTAL_BYTES": "-1"})


def test_tensorflow_inter_op_threads_are_reserved_unless_the_user_chose():
    from hororing.environment import TF_INTER_OP_THREADS, reserve_tf_inter_op_threads
    environ = {}
    assert reserve_tf_inter_op_threads(environ) == TF_INTER_OP_THREADS
    assert environ == {"TF_NUM_INTEROP_THREADS": str(TF_INTER_OP_THREADS)}
    environ = {"HORORING_TF_INTER_OP_THREADS": "8"}
    assert reserve_tf_inter_op_threads(environ) == 8 and environ["TF_NUM_INTEROP_THREADS"] == "8"
    environ = {"TF_NUM_INTEROP_THREADS": "3", "HORORING_TF_INTER_OP_THREADS": "8"}
    assert reserve_tf_inter_op_threads(environ) == 3 and environ["TF_NUM_INTEROP_THREADS"] == "3"
    with pytest.raises(ValueError, match="HORORING_TF_INTER_OP_THREADS must be > 0, got 0"):
        reserve_tf_inter_op_threads({"HORORING_TF_INTER_OP_THREADS": "0"})
    with pytest.raises(ValueError, match="HORORING_TF_INTER_OP_THREADS"):
        reserve_tf_inter_op_threads({"HORORING_TF_INTER_OP_THREADS": "many"})


def test_ring_sub_chunk_depends_on_whether_the_ring_crosses_nodes():
    automatic = Config.from_environ({})
    assert automatic.subchunk_bytes(across_nodes=False) == 1024 * 1024
    assert automatic.subchunk_bytes(across_nodes=True) == 256 * 1024
    chosen = Config.from_environ({"HORORING_RING_SUBCHUNK_BYTES": "65536"})
    assert chosen.subchunk_bytes(across_nodes=False) == chosen.subchunk_bytes(True) == 65536


def test_ring_pieces_grow_only_across_nodes_and_only_unless_the_sub_chunk_is_set():
    automatic = Config.from_environ({})
    assert automatic.piece_ceiling(across_nodes=True) == 1024 * 1024
    assert automatic.piece_ceiling(across_nodes=False) == 0
    chosen = Config.from_environ({"HORORING_RING_SUBCHUNK_BYTES": "262144"})
    assert chosen.piece_ceiling(across_nodes=True) == chosen.piece_ceiling(False) == 0


def test_torch_huge_pages_default_on_unless_the_user_chose():
    from hororing.environment import torch_huge_pages
    environ = {}
    assert torch_huge_pages(environ) and environ["THP_MEM_ALLOC_ENABLE"] == "1"
    environ = {"THP_MEM_ALLOC_ENABLE": "0"}  # the user's own setting stays
    assert not torch_huge_pages(environ) and environ["THP_MEM_ALLOC_ENABLE"] == "0"
    environ = {"HORORING_TORCH_HUGE_PAGES": "0"}
    assert not torch_huge_pages(environ) and "THP_MEM_ALLOC_ENABLE" not in environ
    with pytest.raises(ValueError, match="HORORING_TORCH_HUGE_PAGES"):
        torch_huge_pages({"HORORING_TORCH_HUGE_PAGES": "sometimes"})


def test_importing_the_torch_binding_turns_on_torch_huge_pages():
    import os
    import subprocess
    import sys
    pytest.importorskip("torch")
    environ = {key: value for key, value in os.environ.items()
               if key not in ("THP_MEM_ALLOC_ENABLE", "HORORING_TORCH_HUGE_PAGES")}
    check = ("import os, hororing.torch; "
             "print(os.environ.get('THP_MEM_ALLOC_ENABLE'))")
    for switch, expected in (({}, "1"), ({"HORORING_TORCH_HUGE_PAGES": "0"}, "None"),
                             ({"THP_MEM_ALLOC_ENABLE": "0"}, "0")):
        job = subprocess.run([sys.executable, "-c", check], env={**environ, **switch},
                             capture_output=True, text=True, timeout=120)
        assert job.returncode == 0, job.stderr[-2000:]
        assert job.stdout.strip() == expected, (switch, job.stdout)


def test_readme_lists_every_environment_variable_config_reads():
    """README's table of environment variables is kept in step with config.py and
    environment.py, the one place that reads them: a variable added there must be
    documented."""
    import pathlib
    from hororing.config import _ENV_FIELDS
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    missing = [names[-1] for names in (names for names, _ in _ENV_FIELDS.values())
               if not any(f"`{name}`" in table for name in names)]
    assert not missing, f"README's environment variable table misses {missing}"
    # and the variables read outside Config (launch facts, user switches)
    import re
    package = pathlib.Path(__file__).resolve().parents[2] / "hororing"
    source = "".join((package / name).read_text() for name in READERS)
    named = set(re.findall(r'"((?:HOROVOD|HORORING)_[A-Z_]+[A-Z])"', source))
    missing = sorted(name for name in named if f"`{name}`" not in table)
    assert not missing, f"README's environment variable table misses {missing}"


def test_config_is_the_one_module_that_reads_environment_variables():
    """Every environment variable hororing reads is read in config.py (the settings) or
    environment.py (the launcher's facts, the process switches): a launcher may copy the
    whole environment for its children, but names no variable of its own."""
    import pathlib
    import re
    package = pathlib.Path(__file__).resolve().parents[2] / "hororing"
    reads = re.compile(r"os\.environ(\.get\(|\.setdefault\(|\[)|os\.getenv\(")
    readers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if str(path.relative_to(package)) not in READERS
                     and reads.search(path.read_text()))
    assert readers == [], f"modules that read environment variables themselves: {readers}"
