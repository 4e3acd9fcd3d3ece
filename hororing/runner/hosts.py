"""Host lists as users and schedulers write them, read into (host, slots) pairs.

- ``-H a:4,b:4``;
- host files of ``host slots=N`` lines (Horovod, Open MPI; ``max_slots=`` is accepted and
  left to MPI) or ``host:N`` lines (MPICH, Intel MPI), ``#`` comments allowed;
- files of one line per slot, a host repeated as often as it has slots (PBS's
  ``$PBS_NODEFILE``, LSF's ``LSB_DJOB_HOSTFILE``): a host named on several lines gets the sum;
- LSF's ``LSB_MCPU_HOSTS``: ``"host1 4 host2 4"``.
"""

import pathlib

__all__ = ["hostfile_or_hosts", "parse_hosts", "parse_lsf_hosts", "read_hostfile"]


def hostfile_or_hosts(hostfile, hosts):
    """The (host, slots) pairs of a host file or a ``host:slots,...`` list, or None."""
    if hostfile:
        return read_hostfile(hostfile)
    return parse_hosts(hosts) if hosts else None


def parse_hosts(text):
    """``"a:4,b:2"`` -> [("a", 4), ("b", 2)] (a host without slots has one).

    Raises:
        ValueError: an entry that is not ``host`` or ``host:slots`` with slots >= 1.
    """
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if item:
            host, _, slots = item.partition(":")
            hosts.append(_host_and_slots(item, host, slots))
    if not hosts:
        raise ValueError(f"-H needs host:slots pairs, e.g. node1:4,node2:4; got {text!r}")
    return _merged(hosts)


def read_hostfile(path):
    """Hosts from a file of 'host slots=N' or 'host:N' lines, or of one line per slot.

    Raises:
        ValueError: a line that cannot be read, or a file that names no host.
    """
    hosts = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        words = line.split()
        if len(words) > 1 or "=" in words[0]:
            options = dict(word.partition("=")[::2] for word in words[1:])
            unknown = set(options) - {"slots", "max_slots", "max-slots"}
            if unknown or "=" in words[0]:
                raise ValueError(f"cannot read host entry {line!r} ({path}, line {number}): "
                                 f"expected host:slots or 'host slots=N' with N >= 1")
            hosts.append(_host_and_slots(line, words[0], options.get("slots", ""), path,
                                         number))
        else:
            host, _, slots = line.partition(":")
            hosts.append(_host_and_slots(line, host.strip(), slots.strip(), path, number))
    if not hosts:
        raise ValueError(f"host file {path} lists no hosts")
    return _merged(hosts)


def parse_lsf_hosts(text):
    """LSF's ``LSB_MCPU_HOSTS``, ``"host1 4 host2 4"`` -> [("host1", 4), ("host2", 4)].

    Raises:
        ValueError: not pairs of a host and a count >= 1.
    """
    words = text.split()
    if not words or len(words) % 2 or not all(count.isdigit() and int(count) > 0
                                              for count in words[1::2]):
        raise ValueError(f"cannot read LSF's LSB_MCPU_HOSTS {text!r}: expected pairs of a "
                         f"host and its slots, e.g. 'node1 4 node2 4'")
    return _merged([(host, int(count)) for host, count in zip(words[::2], words[1::2])])


def _host_and_slots(text, host, slots, path=None, number=None):
    where = f" ({path}, line {number})" if path else ""
    if not host or (slots and (not slots.isdigit() or int(slots) < 1)):
        raise ValueError(f"cannot read host entry {text!r}{where}: expected host:slots or "
                         f"'host slots=N' with N >= 1")
    return host, int(slots) if slots else 1


def _merged(hosts):
    """One entry per host, in the order hosts first appear, their slots added."""
    slots = {}
    for host, count in hosts:
        slots[host] = slots.get(host, 0) + count
    return list(slots.items())
