"""How many cores a node's ranks may run on, which ``os.cpu_count()`` does not say.

``os.cpu_count()`` counts the machine's cores. A rank may be held to fewer: its affinity mask
(a launcher's binding, Slurm's or a container's cpuset) lists the cores it may run on, and a
cgroup's CPU quota (``docker --cpus``, a Kubernetes CPU limit: ``cpu.max`` under cgroup v2,
``cpu.cfs_quota_us`` under v1) caps the CPU time its group gets, in cores, whatever the mask
says. A node's ranks may run on the union of their masks, at most the quota.

Whether a node is oversubscribed (more ranks than cores) decides how its waits spin
(``Config.spin_tests``) and when they wake their peers (``transport.set_backoff``'s
``wake_late``), and how the cost model prices CPU work (``Route``'s contention);
with the size of its last-level cache (``last_level_cache``), the segments of the allreduce
through its shared memory (``cost.shared_segment_bytes``).
"""

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
CACHE_ROOT = "/sys/devices/system/cpu/cpu0/cache"


def affinity():
    """The cores this process may run on (its affinity mask), as a sorted list."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def quota(root=CGROUP_ROOT, proc=PROC_CGROUP):
    """The CPU quota of this process's cgroup and the groups above it, in cores (the
    smallest, rounded up; at least 1); None where none is set or none can be read."""
    try:
        with open(proc) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    limits = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":  # cgroup v2: one hierarchy
            limits += _limits(root, path, ("",), _v2)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's hierarchy
            limits += _limits(root, path, (controllers, "cpu", "cpu,cpuacct"), _v1)
    return max(1, math.ceil(min(limits))) if limits else None


def _limits(root, path, mounts, read):
    """The quotas (cores) set on ``path`` and its parents, under any of ``mounts``."""
    found = []
    for mount in mounts:
        base = os.path.join(root, mount) if mount else root
        if not os.path.isdir(base):
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            cores = read(os.path.join(base, *parts[:depth]))
            if cores is not None:
                found.append(cores)
        break
    return found


def _v2(directory):
    try:
        with open(os.path.join(directory, "cpu.max")) as text:
            limit, period = text.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) / int(period)


def _v1(directory):
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as text:
            limit = int(text.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as text:
            period = int(text.read())
    except (OSError, ValueError):
        return None
    return None if limit <= 0 or period <= 0 else limit / period


def node_cores(masks, quotas):
    """The cores a node's ranks may run on, from each rank's ``affinity()`` and ``quota()``:
    their masks' union, at most the smallest quota set (at least 1)."""
    cores = len(set().union(*map(set, masks)))
    limits = [limit for limit in quotas if limit is not None]
    return max(1, min([cores] + limits))


def on_node(local_comm):
    """``node_cores`` of the ranks of ``local_comm`` (one node's ranks; collective)."""
    gathered = local_comm.allgather((affinity(), quota()))
    return node_cores([mask for mask, _ in gathered], [limit for _, limit in gathered])


def last_level_cache(root=CACHE_ROOT):
    """The bytes of the largest data cache the first core sees (its last level, shared with
    the cores listed beside it in sysfs), or None where sysfs does not say."""
    sizes = []
    try:
        entries = os.listdir(root)
    except OSError:
        return None
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "type")) as file:
                kind = file.read().strip()
            with open(os.path.join(root, entry, "size")) as file:
                text = file.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale > 1 else text
        if kind in ("Data", "Unified") and digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None
