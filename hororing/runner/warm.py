"""Warm starts for hororun's relaunches: a process on hororun's host that has imported the job's
heavy modules (torch takes 1-2 s a rank, more with ranks sharing cores) forks each new rank
instead of a fresh interpreter importing them again.

hororun (``--warm-start``, elastic mode) starts ``python -m hororing.runner.warm SOCKET
MODULES`` with the ranks' environment. mpiexec starts ``PYTHON -I -S warm_shim.py SOCKET
COMMAND...`` as each rank. What a library fixes at import from the launcher's variables (torch's
thread pool: MKL sizes it from MPI_LOCALNRANKS and the like) differs between ranks, so warm
processes are keyed by those variables (``warm_shim.KEYED``): the shim asks for the one of its
key at ``SOCKET.<key>``; where there is none yet it asks this process to start one (a fork that
takes the key's values, imports the modules and listens) and execs the command as it is. The
first launch's ranks so make the warm processes the relaunches use.

A warm process forks a rank on request: the shim sends its command, working directory,
environment, signal dispositions and descriptors (stdio, PMI's); the child becomes the rank: the
descriptors in place, the environment and directory the shim's, the signals as in a fresh
process, ``sys.argv`` the command's, and the script run as ``__main__``, so that it exits
through the interpreter as ``python script.py`` would (atexit, MPI_Finalize, its status). The
shim relays signals and exits as the rank exits, with its status or its signal, so mpiexec sees
what it would have seen; a rank whose shim is gone is killed, and every process here dies with
its parent (hororun at the top).

A command is declined, and the shim execs it as it is, unless it is ``PYTHON script ...`` or
``PYTHON -m module ...`` for this interpreter, from this host's network namespace and this
process's control groups (not a scheduler's job step or a container of its own), with the
interpreter's and threading libraries' variables (PYTHON*, OMP_*, MKL_*, KMP_*) as the warm
process has them: those are read once, at start or import, and a fork cannot read them again.
"""
import ast
import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
import runpy
import selectors
import signal
import socket
import sys
import types

from ..environment import torch_huge_pages
from .warm_shim import cgroup, key_name, receive, send

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_shim.py")
# what ``--warm-start auto`` imports ahead, of those the script imports: heavy, and safe to fork
# after (no device context at import; numpy's BLAS remakes its threads in a forked child)
AUTO = ("torch", "torchvision", "numpy", "hororing")
# what those import on first use, when a rank builds its model: torch.optim's first optimizer
# imports torch._dynamo (1.5 s here), hororing's first collective numba (its compiled steps)
LATER = {"torch": ("torch._dynamo",), "hororing": ("numba",)}
_FIXED_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_")
_PR_SET_PDEATHSIG = 1


def auto_modules(command):
    """The modules ``--warm-start auto`` imports ahead for ``command`` (``PYTHON script ...`` or
    ``PYTHON -m module ...``): the script's imports (anywhere in it) whose package is in AUTO."""
    source = None
    if len(command) >= 3 and command[1] == "-m":
        spec = importlib.util.find_spec(command[2]) if _findable(command[2]) else None
        source = spec.origin if spec is not None and spec.has_location else None
    elif len(command) >= 2 and command[1].endswith(".py"):
        source = command[1]
    if source is None:
        return []
    try:
        with open(source, "rb") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
    chosen = [name for name in found if name.split(".")[0] in AUTO]
    later = [name for package in dict.fromkeys(name.split(".")[0] for name in chosen)
             for name in LATER.get(package, ()) if _findable(name)]
    return list(dict.fromkeys(chosen + later))


def _findable(name):
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def wrap(python, socket_path, command):
    """``command`` started through the shim (``python``: the rank's interpreter)."""
    return [python, "-I", "-S", SHIM, socket_path, *command]


def is_python(command):
    """Whether ``command`` is one a warm process could start: ``PYTHON script|-m module``."""
    if len(command) < 2 or not os.path.basename(command[0]).startswith("python"):
        return False
    return command[1] == "-m" and len(command) >= 3 or not command[1].startswith("-")


class Server:
    """The warm process: import, listen, fork ranks, report their ends."""

    def __init__(self, path, modules):
        self.path = path
        self.modules = modules
        self.selector = None  # a warm process's own (never one shared through a fork)
        self.ranks = {}  # a shim's connection -> its rank's pid, while both live
        self.fixed = None  # the variables read once, as the warm process has them
        self.net = os.readlink("/proc/self/ns/net")
        self.python = os.path.abspath(sys.executable)

    def serve(self):
        """Take requests to start warm processes (one per key), each a fork of this one."""
        _die_with_parent()
        listener = _listen(self.path)
        started = set()
        while True:
            conn, _ = listener.accept()
            with conn:
                message = receive(conn)
            key = None if message is None else message.get("prepare")
            if not isinstance(key, dict) or key_name(key) in started:
                continue
            started.add(key_name(key))
            if os.fork() == 0:
                listener.close()
                os.environ.update(key)
                self._warm(f"{self.path}.{key_name(key)}")  # never returns

    def _warm(self, path):
        """In a child: import the modules, then fork ranks on request at ``path``."""
        _die_with_parent()
        try:  # a rank's end is watched through a pidfd (Linux 5.3): without, start none warm
            os.close(os.pidfd_open(os.getpid()))
        except (AttributeError, OSError) as error:
            sys.stderr.write(f"hororun: --warm-start needs pidfd_open (Linux 5.3 or later): "
                             f"{error}; the ranks start fresh\n")
            os._exit(0)
        self.fixed = {name: value for name, value in os.environ.items()
                      if name.startswith(_FIXED_PREFIXES)}
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception as error:  # the rank imports it itself, and says what is wrong
                sys.stderr.write(f"hororun: --warm-start could not import {name}: {error}\n")
        if any(name.split(".")[0] == "hororing" for name in self.modules):
            _preload_compiled_steps()
        listener = _listen(path)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "listener")
        while True:
            self._dispatch(self.selector.select(), listener)

    def _dispatch(self, events, listener):
        """Handle one ``select()``'s events. A rank's end and its shim's connection can be
        ready together, and handling the first closes the second: an event whose object is
        no longer registered (under that key) is skipped."""
        for key, _ in events:
            if self.selector.get_map().get(key.fd) is not key:
                continue
            if key.data == "listener":
                self._accept(listener)
            elif key.data == "rank":
                self._from_shim(key.fileobj)
            else:
                self._ended(key.fileobj, *key.data)

    def _accept(self, listener):
        conn, _ = listener.accept()
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 22, 256)
        except OSError:
            conn.close()
            return
        request = receive(conn, data)
        reason = None if request is None else self.declined(request)
        if reason is not None or len(fds) != len(request["fds"]):
            for fd in fds:
                os.close(fd)
            _reply(conn, {"declined": reason or "descriptors lost on the way"})
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            listener.close()
            self._become(conn, request, fds)  # never returns: the rank runs and exits
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.ranks[conn] = pid
        self.selector.register(conn, selectors.EVENT_READ, "rank")
        self.selector.register(pidfd, selectors.EVENT_READ, (pid, conn))
        _reply(conn, {"pid": pid})

    def declined(self, request):
        """Why this process cannot start ``request``'s command (None: it can)."""
        command, env = request["argv"], request["env"]
        if not is_python(command):
            return "not PYTHON script or PYTHON -m module"
        found = _which(command[0], env.get("PATH", ""), request["cwd"])
        if found is None or os.path.abspath(found) != self.python:
            return f"another interpreter ({command[0]})"
        if request["net"] != self.net:
            return "another host (network namespace)"
        if request["cgroup"] != cgroup():
            return "another control group (a scheduler's job step, a container)"
        theirs = {name: value for name, value in env.items()
                  if name.startswith(_FIXED_PREFIXES)}
        if theirs != self.fixed:
            return "other interpreter or thread-library settings"
        return None

    def _from_shim(self, conn):
        message = receive(conn)
        pid = self.ranks.get(conn)
        if message is None:  # the shim is gone (killed by mpiexec): so is its rank
            self.selector.unregister(conn)
            conn.close()
            del self.ranks[conn]
            _kill(pid, signal.SIGKILL)
        elif "kill" in message:
            _kill(pid, message["kill"])

    def _ended(self, pidfd, pid, conn):
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if conn in self.ranks:
            ended = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else \
                {"exit": os.waitstatus_to_exitcode(status)}
            _reply(conn, ended)
            self.selector.unregister(conn)
            conn.close()
            del self.ranks[conn]

    def _become(self, conn, request, fds):
        """In the child: become the rank ``request`` describes, run it, and exit as it does."""
        _die_with_parent()
        keep = set(request["fds"])
        for key in list(self.selector.get_map().values()):  # the other ranks' and the listener
            if isinstance(key.fileobj, int):
                os.close(key.fileobj)
            else:
                key.fileobj.close()
        self.selector.close()
        conn.close()
        high = [os.dup(fd) for fd in fds]  # out of the way of the numbers they go to
        for fd in fds:
            if fd not in keep:
                os.close(fd)
        for number, fd in zip(request["fds"], high):
            os.dup2(fd, number)
            os.close(fd)
        os.chdir(request["cwd"])
        os.sched_setaffinity(0, request["cpus"])  # the cores mpiexec bound the rank to
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_signals(request["ignored"])
        _after_environment()
        try:
            _run(request["argv"])
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as error:  # reported as the interpreter would, from the script on
            trace = error.__traceback__
            while trace is not None and trace.tb_frame.f_code is not _run.__code__:
                trace = trace.tb_next
            trace = trace.tb_next if trace is not None else error.__traceback__
            sys.excepthook(type(error), error.with_traceback(trace), trace)
            sys.exit(1)
        sys.exit(0)  # through the interpreter's exit, as the script's own end


def _run(command):
    """Run ``command``'s script or module as ``__main__``, as the interpreter would."""
    if command[1] == "-m":
        sys.argv = [command[2], *command[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        return
    # as ``python script``: argv[0] as given, __file__ absolute, a new __main__
    script = os.path.abspath(command[1])
    sys.argv = [command[1], *command[2:]]
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main
    with open(script, "rb") as handle:
        code = compile(handle.read(), script, "exec")
    exec(code, main.__dict__)


def _preload_compiled_steps():
    """The ring's compiled steps, loaded here for every rank forked from this process (each
    would otherwise load them beside its first steps, a second of CPU, more on shared
    cores); MPI stays uninitialised (``compiled.preload``)."""
    try:
        from ..algorithms import compiled
        from ..config import Config

        mode = Config.from_environ().compiled_steps
        why = compiled.preload(mode)
        if why is not None and compiled.expected(mode):
            sys.stderr.write(f"hororun: --warm-start loaded nothing: {why}; each rank loads "
                             f"the compiled steps itself\n")
    except Exception as error:  # the ranks load them themselves, as fresh ones do
        sys.stderr.write(f"hororun: --warm-start could not load the compiled steps: {error}\n")


def _listen(path):
    """A socket listening at ``path``, which appears only once it answers."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)
    return listener


def _reply(conn, message):
    try:
        send(conn, message)
    except OSError:
        pass


def _kill(pid, number):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _which(name, path, cwd):
    if os.sep in name:
        return os.path.join(cwd, name)
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory or cwd, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _fresh_signals(ignored):
    """Every signal as a fresh interpreter has it, those ``ignored`` at the shim ignored."""
    for number in signal.valid_signals():
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    for number, handling in ((signal.SIGINT, signal.default_int_handler),
                             (signal.SIGPIPE, signal.SIG_IGN),
                             (signal.SIGXFSZ, signal.SIG_IGN)):
        signal.signal(number, handling)
    for number in ignored:
        signal.signal(number, signal.SIG_IGN)


def _after_environment():
    """What imported modules set from the environment, set again from the rank's."""
    if "hororing.torch" in sys.modules:
        torch_huge_pages()


def _die_with_parent():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    Server(sys.argv[1], [name for name in sys.argv[2].split(",") if name]).serve()
