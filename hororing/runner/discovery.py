"""Hosts and slots for an elastic job: a discovery script, a fixed list (``-H``, a host file,
a PBS/LSF job's or an MPI Operator's hosts), or the live nodes of the Slurm allocation hororun
runs in."""

import subprocess


class DiscoveryError(RuntimeError):
    """The discovery script failed or printed something that is not a host list."""


class ScriptDiscovery:
    """Runs ``script`` and reads one ``host`` or ``host:slots`` per line (Horovod's format).

    A line without slots gets ``default_slots``. Blank lines and ``#`` comments are skipped.
    """

    def __init__(self, script, default_slots=1, timeout=30.0):
        self.script = script
        self.default_slots = default_slots
        self.timeout = timeout

    def __call__(self):
        try:
            result = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                    timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"host discovery script {self.script!r} did not finish in "
                                 f"{self.timeout:g} s") from None
        if result.returncode != 0:
            raise DiscoveryError(f"host discovery script {self.script!r} exited with status "
                                 f"{result.returncode}: {result.stderr.strip()[-500:]}")
        return parse(result.stdout, self.default_slots, self.script)


class SlurmDiscovery:
    """The nodes a Slurm job holds now, as ``squeue`` reports them.

    ``SLURM_JOB_NODELIST`` is fixed when the job is submitted: after ``scontrol update
    JobId=J NodeList=...`` removes a node it still names it, and a relaunch there fails (srun:
    "Requested node configuration is not available"). squeue gives the live list. Each node
    offers the slots it had in the allocation (``allocation.hosts``); a node it did not have
    offers the most common count.
    """

    def __init__(self, allocation, timeout=30.0):
        self.job_id = allocation.job_id
        self.slots = dict(allocation.hosts)
        counts = [slots for _, slots in allocation.hosts] or [1]
        self.default_slots = max(set(counts), key=counts.count)
        self.timeout = timeout

    def __call__(self):
        from .. import slurm

        command = ["squeue", "-h", "-j", str(self.job_id), "-o", "%N"]
        try:
            result = subprocess.run(command, capture_output=True, text=True,
                                    timeout=self.timeout)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise DiscoveryError(f"{' '.join(command)} failed: {error}") from None
        listed = result.stdout.strip()
        if result.returncode != 0 or not listed:
            raise DiscoveryError(f"{' '.join(command)} gave no nodes for Slurm job "
                                 f"{self.job_id} (status {result.returncode}: "
                                 f"{result.stderr.strip()[-300:]})")
        try:
            nodes = slurm.expand_nodelist(listed.splitlines()[0])
        except ValueError as error:
            raise DiscoveryError(str(error)) from None
        return [(node, self.slots.get(node, self.default_slots)) for node in nodes]


class FixedDiscovery:
    """The hosts of ``-H``/``--hostfile`` (or this machine), which never change."""

    def __init__(self, hosts):
        self.hosts = list(hosts)

    def __call__(self):
        return list(self.hosts)


def choose(script, slots, hosts, *sizes, allocation=None):
    """The discovery of an elastic job: ``script`` if given, else the fixed ``hosts``, else
    the live nodes of the Slurm ``allocation`` the driver runs in (another scheduler's: its
    hosts, fixed), else this machine with as
    many slots as the largest of ``sizes`` (None ignored)."""
    if script:
        return ScriptDiscovery(script, slots or 1)
    if hosts is None and allocation is not None:
        return SlurmDiscovery(allocation) if allocation.managed else FixedDiscovery(allocation.hosts)
    return FixedDiscovery(hosts or [("localhost", max(size or 0 for size in sizes))])


def parse(text, default_slots, source):
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        host, slots = host.strip(), slots.strip()
        if not host or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise DiscoveryError(f"host discovery script {source!r}, line {number}: expected "
                                 f"'host' or 'host:slots' with slots >= 1, got {line!r}")
        hosts.append((host, int(slots) if slots else default_slots))
    seen = set()
    for host, _ in hosts:
        if host in seen:
            raise DiscoveryError(f"host discovery script {source!r} lists {host!r} twice")
        seen.add(host)
    return hosts


def total_slots(hosts):
    return sum(slots for _, slots in hosts)


def assign(hosts, size):
    """The first ``size`` slots of ``hosts``, in their order: [(host, slots used)]."""
    placed, left = [], size
    for host, slots in hosts:
        if left <= 0:
            break
        take = min(slots, left)
        placed.append((host, take))
        left -= take
    return placed
