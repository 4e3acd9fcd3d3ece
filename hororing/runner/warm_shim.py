"""What mpiexec starts in place of a rank's command under ``hororun --warm-start``: ask the warm
process on this host for this rank's key (``warm.py``) to fork the rank from a process that has
imported the job's heavy modules already, relay signals to it, and exit as it exits (its
status, or its signal). Where no warm process answers, or it declines the command, the shim
asks for one to be made for the next launch and execs the command as it is.

Run as ``PYTHON -I -S warm_shim.py SOCKET COMMAND...``: the standard library only, no site, so
that it starts in milliseconds. Shares its framing with ``warm.py`` by value, not by import.
"""

import hashlib
import json
import os
import signal
import socket
import struct
import sys

# what mpiexec forwards to a rank, relayed to the forked one
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGWINCH)
# what libraries read at import to size themselves, which a launcher sets per rank (MKL, and so
# torch's thread pool: the ranks sharing this host); a warm process is kept per their values
KEYED = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "I_MPI_NUMBER_OF_MPI_PROCESSES_PER_NODE",
         "I_MPI_PIN_MAPPING")


def key_of(env):
    return {name: env[name] for name in KEYED if name in env}


def key_name(key):
    return hashlib.sha1(json.dumps(sorted(key.items())).encode()).hexdigest()[:12]


def send(sock, message, fds=()):
    data = json.dumps(message).encode()
    data = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def receive(sock, start=b""):
    """The next message (``start``: its first bytes, read already, as with descriptors by
    ``socket.recv_fds``), or None once the peer is gone."""
    data = start + (_exactly(sock, max(0, 4 - len(start))) or b"")
    if len(data) < 4:
        return None
    size = struct.unpack("!I", data[:4])[0]
    rest = _exactly(sock, max(0, 4 + size - len(data)))
    return None if rest is None else json.loads((data + rest)[4:4 + size])


def _exactly(sock, count):
    data = b""
    while len(data) < count:
        try:
            chunk = sock.recv(count - len(data))
        except ConnectionError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def open_fds(skip):
    """This process's open descriptors (inherited from mpiexec: stdio, PMI's), but ``skip``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == skip:
            continue
        try:
            os.fstat(fd)
        except OSError:  # the listing's own descriptor, closed by now
            continue
        found.append(fd)
    return sorted(found)


def cgroup():
    """This process's control groups (a job step's, a container's), as /proc says them."""
    try:
        with open("/proc/self/cgroup") as handle:
            return handle.read()
    except OSError:
        return ""


def forked(path, command):
    """Have the warm process at ``path`` start ``command``: the connection and the rank's pid,
    or None (no warm process here, or it declined)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        fds = open_fds(sock.fileno())
        ignored = [int(number) for number in FORWARDED
                   if signal.getsignal(number) == signal.SIG_IGN]
        send(sock, {"argv": command, "cwd": os.getcwd(), "env": dict(os.environ), "fds": fds,
                    "ignored": ignored, "net": os.readlink("/proc/self/ns/net"),
                    "cgroup": cgroup(), "cpus": sorted(os.sched_getaffinity(0))}, fds)
        reply = receive(sock)
    except OSError:
        reply = None
    if reply is None or "pid" not in reply:
        sock.close()
        return None
    for fd in fds:  # the rank holds them now: its end closes them (stdio, PMI's), not ours
        os.close(fd)
    return sock, reply["pid"]


def prepare(path, key):
    """Ask the process at ``path`` to start a warm process for ``key`` (for the next rank)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        send(sock, {"prepare": key})
    except OSError:
        pass
    finally:
        sock.close()


def main():
    path, command = sys.argv[1], sys.argv[2:]
    key = key_of(os.environ)
    # a signal that arrives while the rank starts (its output may come before this process
    # reads the reply) waits for the relay, instead of taking its default action here
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    started = forked(f"{path}.{key_name(key)}", command)
    if started is None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the command exec'd as it is
        prepare(path, key)
        os.execvp(command[0], command)
    sock, _ = started

    def relay(number, _frame):
        try:
            send(sock, {"kill": number})
        except OSError:
            pass
    for number in FORWARDED:
        signal.signal(number, relay)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # what waited is relayed now
    ended = receive(sock)
    if ended is None:  # the warm process died: the rank with it (its death signal)
        sys.stderr.write("hororun: the warm process that started this rank is gone\n")
        os._exit(1)
    if "signal" in ended:  # end as the rank did, so that mpiexec reports the same
        number = ended["signal"]
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
        os.kill(os.getpid(), number)
    os._exit(ended.get("exit", 1))


if __name__ == "__main__":
    main()
