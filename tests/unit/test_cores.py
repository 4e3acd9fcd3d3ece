"""The cores a node's ranks may run on (hororing/cores.py): their affinity masks' union, at
most the cgroup's CPU quota, read from cgroup trees written here."""

import os

import pytest

from hororing import cores


def cgroup_tree(tmp_path, proc_lines, files):
    """A /proc/self/cgroup with ``proc_lines`` and a cgroup root holding ``files``."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    return str(root), str(proc)


def test_a_v2_quota_is_read_in_cores_rounded_up(tmp_path):
    root, proc = cgroup_tree(tmp_path, ["0::/job"], {"job/cpu.max": "250000 100000\n"})
    assert cores.quota(root, proc) == 3


def test_the_smallest_quota_of_the_group_and_its_parents_holds(tmp_path):
    root, proc = cgroup_tree(tmp_path, ["0::/pod/job"], {
        "cpu.max": "max 100000\n", "pod/cpu.max": "150000 100000\n",
        "pod/job/cpu.max": "800000 100000\n"})
    assert cores.quota(root, proc) == 2


def test_no_quota_set_or_readable_is_none(tmp_path):
    root, proc = cgroup_tree(tmp_path, ["0::/job"], {"job/cpu.max": "max 100000\n"})
    assert cores.quota(root, proc) is None
    root, proc = cgroup_tree(tmp_path / "bare", ["0::/"], {})
    assert cores.quota(root, proc) is None
    assert cores.quota(root, str(tmp_path / "no_such_file")) is None


def test_a_v1_quota_is_read_from_the_cpu_controllers_hierarchy(tmp_path):
    root, proc = cgroup_tree(
        tmp_path, ["4:memory:/docker/x", "2:cpu,cpuacct:/docker/x", "1:cpuset:/"],
        {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000\n",
         "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
         "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cores.quota(root, proc) == 1  # half a core: at least one
    root, proc = cgroup_tree(tmp_path / "unlimited", ["2:cpu,cpuacct:/"],
                             {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                              "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cores.quota(root, proc) is None


@pytest.mark.parametrize("masks, quotas, expected", [
    ([[0], [1], [2], [3]], [None] * 4, 4),        # a core bound to each rank
    ([[0, 1], [0, 1], [0, 1]], [None] * 3, 2),    # ranks sharing the node's two cores
    ([[0], [0]], [None, None], 1),                # two ranks bound to one core
    ([list(range(64))] * 8, [2, 2] + [2] * 6, 2),  # 64 cores seen, a 2-core quota
    ([[0, 1, 2, 3]] * 2, [None, 8], 4),           # a quota above the mask: the mask
])
def test_a_node_has_its_masks_union_at_most_the_quota(masks, quotas, expected):
    assert cores.node_cores(masks, quotas) == expected


def test_this_process_may_run_on_its_affinity_mask():
    assert cores.affinity() == sorted(os.sched_getaffinity(0))


def _cache(root, index, level, kind, size):
    entry = root / f"index{index}"
    entry.mkdir(parents=True)
    (entry / "level").write_text(f"{level}\n")
    (entry / "type").write_text(f"{kind}\n")
    (entry / "size").write_text(f"{size}\n")


def test_the_last_level_cache_is_the_largest_data_cache_sysfs_lists(tmp_path):
    _cache(tmp_path, 0, 1, "Data", "48K")
    _cache(tmp_path, 1, 1, "Instruction", "32K")
    _cache(tmp_path, 2, 2, "Unified", "2048K")
    _cache(tmp_path, 3, 3, "Unified", "107520K")
    assert cores.last_level_cache(str(tmp_path)) == 107520 << 10
    (tmp_path / "uevent").write_text("")  # not an index: passed over


def test_a_cache_size_in_megabytes_and_no_sysfs_at_all(tmp_path):
    _cache(tmp_path, 0, 1, "Data", "32K")
    _cache(tmp_path, 3, 3, "Unified", "32M")
    assert cores.last_level_cache(str(tmp_path)) == 32 << 20
    assert cores.last_level_cache(str(tmp_path / "missing")) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    _cache(empty, 1, 1, "Instruction", "32K")  # no data cache listed
    assert cores.last_level_cache(str(empty)) is None


def test_this_machine_says_its_cache_or_nothing():
    found = cores.last_level_cache()
    assert found is None or found >= 1 << 10
