"""The ring's steps compiled with numba, loaded beside the job and used once ready.

A ring step in Python costs microseconds of interpreter time (posting, testing, slicing,
reducing a piece); compiled, the whole schedule runs as one call into machine code that calls
MPI itself (``native.py``). numba takes a second or more to import and each kind of buffer
compiles (or loads from numba's disk cache) on first use, so none of that happens on
``import hororing`` or ``hvd.init()``: once a kind of buffer (a dtype; for the ring, also
whether its input is read-only) has had ``after`` calls, it asks for its compiled steps and
runs its Python steps while a background thread loads them; later calls run compiled (a job
that never runs that many never loads numba: loading costs more CPU than a short job's
Python steps). Both give the same bits, and their messages match, so ranks may switch at
different calls.

Modes (Config.compiled_steps, HORORING_COMPILED_STEPS): "auto" as above (``after``:
Config.compiled_steps_after); "wait": load at first use and wait for it (tests and
benchmarks); "off": Python only.
Where numba (or the MPI library's symbols) cannot be loaded, the Python steps run and
``status()`` says why.
"""

import atexit
import hashlib
import logging
import os
import threading

import numpy as np

from ..._mpi import MPI
from ...ops import bfloat16, is_bfloat16

MODES = ("auto", "wait", "off")
# dtypes whose compiled reductions are numpy's (and ml_dtypes') bit for bit: the 16-bit
# floats as their bits, each operation widened to float32 and rounded back; bool and complex
# take the Python steps. bfloat16 joins them (``admitted``) once ml_dtypes is loaded, which
# hororing leaves to the first bfloat16 array (``ops.bfloat16``)
DTYPES = {np.dtype(name) for name in (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64")}
# what params[P_HALF] says 16-bit bits are (0: integers)
HALVES = {np.dtype(np.float16): 1}


def admitted(dtype):
    """Whether the compiled steps take ``dtype``'s buffers: one of DTYPES, or ml_dtypes'
    bfloat16, which joins DTYPES and HALVES here."""
    if dtype in DTYPES:
        return True
    if not is_bfloat16(dtype):
        return False
    HALVES[dtype] = 2
    DTYPES.add(dtype)
    return True


def every_dtype():
    """Every dtype the compiled steps take (bfloat16's loaded and admitted)."""
    admitted(bfloat16())
    return DTYPES


def carried(dtype):
    """The dtype the compiled steps see ``dtype``'s arrays as: the 16-bit floats as uint16
    (numba has neither on the CPU; ``params[P_HALF]`` says what the bits are)."""
    return _BITS if dtype in HALVES else dtype


_BITS = np.dtype(np.uint16)


def handle(obj):
    """An mpi4py object's MPI handle as an int64, as the compiled steps read it (mpi4py
    gives handles as unsigned 64-bit values)."""
    value = MPI._handleof(obj)
    return value - (1 << 64) if value >= 1 << 63 else value

log = logging.getLogger("hororing")


class _Loader:
    lock = threading.Lock()  # the queue's: held for moments, never across a compile
    compiling = threading.Lock()  # held while numba loads or compiles
    mode = "auto"
    after = 1  # the call of a kind that asks for its steps in "auto" mode
    calls = {}  # key -> calls that found no steps, until the key is asked for
    native = None  # the loaded module
    error = None  # why it could not be loaded
    entries = {}  # (dtype, source read-only) -> the compiled ring's entry point
    queued = set()
    thread = None
    wanted = []  # keys the background thread has still to compile
    folded_fresh = False  # folded.py's cached code checked against the sources (``_fresh``)


def configure(mode, after=1):
    """Set the mode (one of ``MODES``) and, for "auto", the call of a kind of buffer that asks
    for its steps (``after``, from 1); a process-wide setting, as the waits' back-off is."""
    if mode not in MODES:
        raise ValueError(f"compiled steps must be one of {', '.join(MODES)} "
                         f"(HORORING_COMPILED_STEPS), got {mode!r}")
    if after < 1:
        raise ValueError(f"the compiled steps are asked for at call 1 at the earliest "
                         f"(HORORING_COMPILED_STEPS_AFTER), got {after}")
    _Loader.mode = mode
    _Loader.after = after
    _Loader.calls = {}
    FOLD_ASKED.clear()
    FOLD_READY.clear()
    if mode != "off":
        FOLD_READY.update((key[1], entry) for key, entry in _Loader.entries.items()
                          if key[0] == "fold")


def mode():
    """The mode in effect (``configure``)."""
    return _Loader.mode


def expected(mode):
    """Whether the compiled steps are meant to run with ``mode``: not "off", and numba
    installed (found, not imported). The cost model prices the ring by it; the job agrees
    on it across ranks (each rank's choice of algorithm must be the same)."""
    if mode == "off":
        return False
    import importlib.util
    return importlib.util.find_spec("numba") is not None


def status():
    """"compiled", "loading", "python (off)", "python (until <after> calls of a kind)" or
    "python (<why numba could not load>)"."""
    if _Loader.mode == "off":
        return "python (off)"
    if _Loader.error is not None:
        return f"python ({_Loader.error})"
    if _Loader.entries:
        return "compiled"
    return "loading" if _Loader.queued else f"python (until {_Loader.after} calls of a kind)"


def ring_entry(dtype, read_only=False):
    """The compiled ring for buffers of ``dtype`` (``read_only``: an input out of place that
    is not writeable), or None: not loaded yet, or not a dtype it takes. Python's steps then
    run, and in "auto" mode the compiled ones are asked for. The caller has checked that
    its arrays are C-contiguous, writeable where written, and in native byte order."""
    if _Loader.mode == "off" or _Loader.error is not None:
        return None
    key = (dtype, read_only)
    entry = _Loader.entries.get(key)
    if entry is not None or (dtype not in DTYPES and not admitted(dtype)):
        return entry
    if _Loader.mode == "wait":
        with _Loader.compiling:
            _compile(key)
        return _Loader.entries.get(key)
    # counted per kind, inline (the lane's hot path); a count a racing thread loses only
    # asks a call later
    calls = _Loader.calls[key] = _Loader.calls.get(key, 0) + 1
    if calls >= _Loader.after:
        _ask(key)
    return None


# the compiled fold cycles ready to run, by dtype (read by the lane without a call), and
# the dtypes ``fold_entry`` has answered None for since the mode was last set, once asked
# for or never to be had (not asked again: in "auto" mode the loader adds the dtype to
# FOLD_READY once it is compiled)
FOLD_READY = {}
FOLD_ASKED = set()


def fold_entry(dtype):
    """The compiled fold cycle (``folded.cycle``) for rows of ``dtype``, or None, as
    ``ring_entry`` answers (in "auto" mode asked for at the ``after``-th None). The caller
    looks in FOLD_READY first, and asks here only for a dtype not in FOLD_ASKED."""
    entry = None
    if _Loader.mode != "off" and _Loader.error is None and (dtype in DTYPES or admitted(dtype)):
        key = ("fold", dtype)
        if _Loader.mode == "wait":
            with _Loader.compiling:
                _compile(key)
            entry = _Loader.entries.get(key)
        else:
            entry = _Loader.entries.get(key)
            if entry is None:
                calls = _Loader.calls[key] = _Loader.calls.get(key, 0) + 1  # as ring_entry
                if calls < _Loader.after:
                    return None  # asked again at the next call, until it is due
                _ask(key)
    if entry is None:
        FOLD_ASKED.add(dtype)
    return entry


# what a warm process loads ahead for the ranks it forks (``preload``): gradients' dtypes
# (and bfloat16, ``ops.bfloat16``)
PRELOADED = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))


def preload(mode):
    """Load the compiled steps for ``PRELOADED`` in a process that forks ranks before they
    initialise MPI (hororun's warm process, ``runner/warm.py``), so that a forked rank's
    rings run compiled from the first, instead of beside a loader taking the CPU for a second.

    The MPI library is mapped by loading mpi4py's extension without importing it (``dlopen``
    only: MPI stays uninitialised, and the rank's ``import mpi4py.MPI`` finds the same
    library); nothing is done where that does not map it. Returns None once they are loaded,
    else why nothing was.
    """
    if mode == "off" or not expected(mode):
        return "the compiled steps are off, or numba is not installed"
    brain = bfloat16()
    admitted(brain)  # it joins DTYPES and HALVES beside PRELOADED
    keys = [(dtype, False) for dtype in PRELOADED + (brain,)]
    keys.append(("fold", np.dtype(np.float32)))
    why = compile_ahead(keys)[1]
    return None if why is None else str(why)


def map_mpi_library():
    """Map the MPI library mpi4py links to into this process without initialising MPI
    (``dlopen`` of mpi4py's extension, not its import), so that the compiled steps' MPI
    symbols resolve. None once it is mapped, else why not (MPI imported already, which
    this is for processes that have not: they fork ranks, or only compile)."""
    import ctypes
    import importlib.util
    import sys

    if "mpi4py.MPI" in sys.modules:
        return "MPI is imported already"
    try:
        ctypes.CDLL(importlib.util.find_spec("mpi4py.MPI").origin, mode=ctypes.RTLD_GLOBAL)
    except (AttributeError, ImportError, OSError) as error:
        return f"mpi4py's extension could not be loaded ({error})"
    if mapped_library() is None:  # else native would import mpi4py.MPI, initialising MPI
        return "no MPI library was mapped with mpi4py's extension"
    return None


def every_key(dtypes=None):
    """The loader's keys for ``dtypes`` (default: every dtype it takes), grouped by the
    dtype the compiled code sees (float16, bfloat16 and uint16 are one compile): for each,
    the ring with its input writable and read-only, and the fold cycle."""
    groups = {}
    for dtype in sorted(every_dtype() if dtypes is None else dtypes, key=str):
        groups.setdefault(carried(dtype), []).extend(
            [(dtype, False), (dtype, True), ("fold", dtype)])
    return list(groups.values())


def compile_ahead(keys):
    """Compile (or load from numba's disk cache) the steps for ``keys`` now, in this process,
    which must not have initialised MPI; what ``python -m hororing.algorithms.compiled`` runs
    to fill the cache before a job (an image's build, a read-only install). Returns
    ``(seconds per key, None)``, or ``(the seconds so far, why it stopped)``."""
    import time

    why = map_mpi_library()
    if why is not None:
        return {}, why
    seconds = {}
    with _Loader.compiling:
        for key in keys:
            began = time.perf_counter()
            _compile(key)
            if _Loader.error is not None:
                return seconds, _Loader.error
            seconds[key] = time.perf_counter() - began
    return seconds, None


def cache_counts():
    """(compiled, loaded from the disk cache): the compiled functions' signatures made this
    process, each way, from numba's own counts."""
    native = _Loader.native
    if native is None:
        return 0, 0
    from . import folded
    compiled = loaded = 0
    for function in (native.ring, native.test_slot, folded.cycle):
        compiled += sum(function.stats.cache_misses.values())
        loaded += sum(function.stats.cache_hits.values())
    return compiled, loaded


# every source compiled code is made from: numba checks a cached function against its own
# file only, so a change to another (codes.py's field numbers, native.py's reductions, which
# folded.py's cycle inlines) would leave the old machine code looking valid
SOURCES = ("codes.py", "native.py", "folded.py")


def sources_stamp():
    """A digest of ``SOURCES`` as a non-negative int64: what a module's compiled code was
    made from (``native.built_from``, ``folded.built_from``)."""
    digest = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in SOURCES:
        with open(os.path.join(here, name), "rb") as source:
            digest.update(source.read())
    return int.from_bytes(digest.digest()[:7], "little")


def _fresh(module):
    """Drop ``module``'s functions from numba's disk cache where its cached code was made
    from other sources than these (its ``built_from()``, loaded from the cache, gives the
    digest it was compiled with); they compile again on first use. Raises where the cache
    cannot be emptied or the code made again still says otherwise."""
    from numba.core.dispatcher import Dispatcher

    if module.built_from() == module.STAMP:
        return
    for value in vars(module).values():
        if isinstance(value, Dispatcher) and value.py_func.__module__ == module.__name__ \
                and value._cache is not None:
            value._cache.flush()
    module.built_from.recompile()
    if module.built_from() != module.STAMP:
        raise RuntimeError(f"{module.__name__}'s compiled code was made from other sources "
                           f"and could not be made again")
    log.info("hororing: %s's cached compiled code was made from other sources: compiled "
             "again", module.__name__)


def cache_path():
    """Where numba keeps the compiled steps' disk cache for this installation."""
    if _load() is None:
        return None
    return _Loader.native.ring._cache.cache_path


def mapped_library():
    """The MPI library mapped into this process (a path), or None."""
    import os

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            name = os.path.basename(path)
            if name.startswith(("libmpi.so", "libmpich.so")) or \
                    (name.startswith("libmpi") and ".so" in name and "cxx" not in name
                     and "fort" not in name):
                return path
    return None


def module():
    """``native``, loaded (waits for the loader); None where it cannot be loaded."""
    if _Loader.native is not None:
        return _Loader.native
    with _Loader.compiling:
        return _load()


def _ask(key):
    with _Loader.lock:
        if key in _Loader.queued:
            return
        _Loader.queued.add(key)
        _Loader.wanted.append(key)
        if _Loader.thread is None or not _Loader.thread.is_alive():
            _Loader.thread = threading.Thread(target=_work, name="hororing-compile",
                                              daemon=True)
            _Loader.thread.start()
            atexit.register(_finish)


def _finish():
    """At exit, let a compile under way end (the interpreter must not stop inside it)."""
    thread = _Loader.thread
    if thread is not None:
        thread.join(timeout=60.0)


def _work():
    while True:
        with _Loader.lock:
            if not _Loader.wanted:
                _Loader.thread = None
                return
            key = _Loader.wanted.pop(0)
        with _Loader.compiling:
            _compile(key)


def _load():
    if _Loader.native is None and _Loader.error is None:
        try:
            from . import native
            _fresh(native)
        except Exception as error:  # numba missing or broken, no MPI symbols: Python steps
            _Loader.error = f"{type(error).__name__}: {error}"
            log.info("hororing: the ring's compiled steps are off: %s", _Loader.error)
            return None
        _Loader.native = native
    return _Loader.native


def _compile(key):
    """Compile (or load from numba's cache) the ring for ``key`` (dtype, read only), or the
    fold cycle ("fold", dtype); under ``compiling``."""
    if key in _Loader.entries:
        return
    native = _load()
    if native is None:
        return
    try:
        import numba
        from numba import types
        if isinstance(key[0], str):  # the fold cycle: ("fold", dtype)
            from . import folded
            if not _Loader.folded_fresh:
                _fresh(folded)
                _Loader.folded_fresh = True
            dtype = key[1]
            array = types.Array(numba.from_dtype(carried(dtype)), 1, "C")
            signature = (array, array, types.Array(types.int64, 1, "C"))
            folded.cycle.compile(signature)
            entry = _Loader.entries[key] = folded.cycle.overloads[signature].entry_point
            if _Loader.mode != "off":
                FOLD_READY[dtype] = entry
            return
        dtype, read_only = key
        element = numba.from_dtype(carried(dtype))
        array = types.Array(element, 1, "C")
        source = types.Array(element, 1, "C", readonly=read_only)
        table = types.Array(types.int64, 2, "C")
        vector = types.Array(types.int64, 1, "C")
        flag = types.Array(types.int32, 1, "C")
        signature = (table, source, array, table, table, vector, vector, vector, flag, vector)
        native.ring.compile(signature)
        native.test_slot.compile((vector, types.int64, flag, vector))
        _Loader.entries[key] = native.ring.overloads[signature].entry_point
    except Exception as error:  # a compiler failure: the Python steps run
        _Loader.error = f"{type(error).__name__}: {error}"
        what = f"the fold cycle for {key[1]}" if isinstance(key[0], str) else \
            f"the ring's steps for {key[0]}"
        log.warning("hororing: compiling %s failed, the Python steps run: %s", what,
                    _Loader.error)
