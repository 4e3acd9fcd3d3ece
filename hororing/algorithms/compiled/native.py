"""The ring's steps compiled with numba: MPI called from nopython code.

Imported only by ``compiled.load`` (off the import path: numba takes a second or more to
import). MPI is reached through the library mpi4py loaded, by symbol name: numba emits a call
to ``MPI_Isend`` and the JIT linker finds it in that library (made visible to it with
``load_library_permanently``), so the compiled functions hold no process-specific address and
numba caches them on disk (``cache=True``: ``__pycache__`` beside this file, or numba's
user-wide cache directory where that is not writable, or ``NUMBA_CACHE_DIR``).

Handles (communicator, datatype, request) are passed as 64-bit integers: an MPI whose handles
are pointers (Open MPI) takes them as they are; one whose handles are ``int`` (MPICH) reads
the low 32 bits of the register, as the C calling conventions of x86-64 and AArch64 have it.
Request slots are 8 bytes each, the larger of the two sizes.

``ring`` is one resumable state machine: it runs until it must hand something to Python (a
piece to finalize, a wait long enough to sleep in) and returns an event; called again with
the same state it goes on where it stopped. Every point it can stop at either repeats a test
that has already succeeded (a completed request is MPI_REQUEST_NULL, which tests done at
once) or lies after the step's last side effect, so re-entry never sends or reduces twice.
The messages are the Python ring's (``algorithms/ring.py``): the same pieces, tags and order,
so a compiled rank and a Python rank can share one ring, and the reductions combine the same
values in the same order, so both give the same bits.
"""

import llvmlite.binding as llvm
import numba
from numba import types
from numba.core import cgutils
from llvmlite import ir
from numba.extending import intrinsic, overload

from ..._mpi import MPI
from . import mapped_library, sources_stamp
from .codes import (DONE, FINALIZE, FIN_START, FIN_STOP, ERROR, INDEX, PC, POSTED, P_BYTE,
                    P_COMM, P_FINALIZE, P_IN_PLACE, P_LARGEST, P_LEFT, P_OP, P_RIGHT,
                    P_HALF, P_SPIN, P_YIELD, SLOT, SLOT_BYTES, TAG, WAIT)

# the digest of the sources this process has (``compiled.sources_stamp``); ``built_from``
# gives the one the cached code was compiled with (a global is a constant to numba)
STAMP = sources_stamp()


@numba.njit(cache=True)
def built_from():
    """The sources' digest this module's cached code was compiled with (``STAMP`` when it
    was compiled: ``compiled._fresh``)."""
    return STAMP


def library_path():
    """The MPI library this process loaded (through mpi4py), by its mapped file: mapped
    already where mpi4py's extension was loaded without being imported (a warm process,
    ``compiled.preload``; MPI not initialised), else once mpi4py's MPI is imported."""
    path = mapped_library()
    if path is None:
        MPI.Get_version()  # mpi4py's MPI imported: its library mapped
        path = mapped_library()
    if path is None:
        raise OSError("no MPI library is mapped into this process (is mpi4py's MPI "
                      "imported?)")
    return path


llvm.load_library_permanently(library_path())

_H = types.int64  # a handle, whatever its C type (see the module's docstring)
_isend = types.ExternalFunction(
    "MPI_Isend", types.int32(types.voidptr, types.int32, _H, types.int32, types.int32, _H,
                             types.voidptr))
_irecv = types.ExternalFunction(
    "MPI_Irecv", types.int32(types.voidptr, types.int32, _H, types.int32, types.int32, _H,
                             types.voidptr))
_test = types.ExternalFunction(
    "MPI_Test", types.int32(types.voidptr, types.voidptr, types.voidptr))
_sched_yield = types.ExternalFunction("sched_yield", types.int32())


@numba.njit(cache=True, nogil=True)
def _wait(slots, slot, flag, status, spin, yields):
    """Test request ``slot`` until done, spinning then yielding (transport's first two
    phases); 1 done, 0 not yet (the caller sleeps in Python), < 0 an MPI error code."""
    address = slots.ctypes.data + slot * SLOT_BYTES
    tests = 0
    while True:
        flag[0] = 0
        code = _test(address, flag.ctypes.data, status.ctypes.data)
        if code != 0:
            return -code
        if flag[0] != 0:
            return 1
        tests += 1
        if tests >= yields:
            return 0
        if tests >= spin:
            _sched_yield()


READY = 3  # from _await: the request completed (never returned by ``ring``)


@numba.njit(cache=True, nogil=True, inline="always")
def _await(slots, slot, state, flag, status, spin, yields):
    """Wait for request ``slot`` as ``_wait`` does: READY when it completed, else the event
    ``ring`` returns (WAIT with state[SLOT] set, or -1 with the MPI error in state[ERROR])."""
    done = _wait(slots, slot, flag, status, spin, yields)
    if done > 0:
        return READY
    if done < 0:
        state[ERROR] = -done
        return -1
    state[SLOT] = slot
    return WAIT


@numba.njit(cache=True, nogil=True)
def test_slot(slots, slot, flag, status):
    """One test of request ``slot``: True when done (Python's sleeping phase calls it)."""
    flag[0] = 0
    code = _test(slots.ctypes.data + slot * SLOT_BYTES, flag.ctypes.data, status.ctypes.data)
    if code != 0:
        return True  # the next ``ring`` call tests it again and reports the error
    return flag[0] != 0


@intrinsic
def _pointer(typingctx, address):
    """An address (int64) as a void pointer, for ``numba.carray``."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _at(parts, pieces, most, chunk, tag, element, item):
    """The address of ``element`` of the output, in piece ``tag`` of ``chunk``'s part."""
    part = pieces[chunk, most + 2 + tag]
    return parts[part, 0] + (element - parts[part, 1]) * item


@intrinsic
def _widen(typingctx, bits):
    """float16 bits (uint16) as the float32 they stand for (exact)."""
    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _narrow(typingctx, value):
    """A float32 rounded to float16 (to nearest even, subnormals and overflow as IEEE
    has them), as its bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _pick_16(into, values, op, half):
    """A min (``op`` 1) or max of 16-bit float bits (``half``: 1 float16, 2 bfloat16),
    compared as float32: a NaN wins; of two equal values, ``into``'s (numpy's float16 and
    ml_dtypes' minimum and maximum keep the first)."""
    for i in range(into.size):
        if half == 1:
            a, b = _widen(into[i]), _widen(values[i])
        else:
            a, b = _widen_bfloat16(into[i]), _widen_bfloat16(values[i])
        if op == 1:
            keep = a <= b or a != a
        else:
            keep = a >= b or a != a
        if not keep:
            into[i] = values[i]


@numba.njit(cache=True, nogil=True, inline="always")
def _reduce_half(into, values, op):
    """``_reduce`` on float16 values held as their bits: each operation in float32, the
    result rounded to float16, as numpy's float16 loops compute (a NaN in a sum or product is
    ``values``' where both are NaN, made quiet; min and max: ``_pick_16``)."""
    quiet = numba.uint16(0x0200)
    count = into.size
    if op == 0 or op == 3:
        for i in range(count):
            a = _widen(into[i])
            b = _widen(values[i])
            if b != b:  # numpy's float16 loops: the second operand's NaN, made quiet
                into[i] = values[i] | quiet
            elif a != a:
                into[i] = into[i] | quiet
            else:
                into[i] = _narrow(a + b if op == 0 else a * b)
    else:
        _pick_16(into, values, op, 1)


@intrinsic
def _widen_bfloat16(typingctx, bits):
    """bfloat16 bits (uint16) as the float32 they stand for (its upper half)."""
    def codegen(context, builder, signature, args):
        word = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(word, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _float_bits(typingctx, value):
    """A float32's bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _reduce_bfloat16(into, values, op):
    """``_reduce`` on bfloat16 values held as their bits, as ml_dtypes' loops compute: each
    operation in float32, rounded to nearest even; a NaN result is the quiet NaN 0x7fc0 with
    the sign of the NaN operand (the second where both are) or of the float32 result; min
    and max: ``_pick_16``)."""
    sign, nan = numba.uint16(0x8000), numba.uint16(0x7fc0)
    count = into.size
    if op == 0 or op == 3:
        for i in range(count):
            a = _widen_bfloat16(into[i])
            b = _widen_bfloat16(values[i])
            if b != b:
                into[i] = (values[i] & sign) | nan
            elif a != a:
                into[i] = (into[i] & sign) | nan
            else:
                result = a + b if op == 0 else a * b
                bits = _float_bits(result)
                if result != result:
                    into[i] = numba.uint16((bits >> 16) & 0x8000) | nan
                else:
                    into[i] = numba.uint16((bits + numba.uint32(0x7FFF)
                                            + ((bits >> 16) & numba.uint32(1))) >> 16)
    else:
        _pick_16(into, values, op, 2)


def _combine(into, values, op, half):
    """``into`` (op)= ``values``: float16 (``half`` 1) or bfloat16 (2) bits, else as their
    dtype."""


@overload(_combine)
def _combine_typed(into, values, op, half):
    if into.dtype == types.uint16:  # the 16-bit floats travel as their bits
        def combine_bits(into, values, op, half):
            if half == 1:
                _reduce_half(into, values, op)
            elif half == 2:
                _reduce_bfloat16(into, values, op)
            else:
                _reduce(into, values, op)
        return combine_bits

    def combine(into, values, op, half):
        _reduce(into, values, op)
    return combine


@numba.njit(cache=True, nogil=True, inline="always")
def _reduce(into, values, op):
    """into (op)= values, as numpy's ufuncs do (a NaN wins a min or max; of two equal
    values, such as 0 and -0, the second's). On views indexed from 0, so that the loops
    vectorize (an offset index is checked for wrapping around at each element)."""
    count = into.size
    if op == 0:
        for i in range(count):
            into[i] = into[i] + values[i]
    elif op == 3:
        for i in range(count):
            into[i] = into[i] * values[i]
    elif op == 1:
        for i in range(count):
            a = into[i]
            b = values[i]
            if not (a < b or a != a):
                into[i] = b
    else:
        for i in range(count):
            a = into[i]
            b = values[i]
            if not (a > b or a != a):
                into[i] = b


@numba.njit(cache=True, nogil=True)
def ring(parts, source, scratch, pieces, steps, slots, state, params, flag, status):
    """Run the ring's schedule until done or until Python is needed; returns an event.

    Args:
        parts: int64 (parts, 2): the output's arrays (one, or a ``Segmented`` buffer's), each
            its address and its first element's offset in the flat output (the input too,
            in place).
        source: the input out of place (any array of the dtype in place: unread).
        scratch: two halves of ``params[P_LARGEST]`` elements each, in place.
        pieces: int64 (chunks, 2 x most pieces + 2): a chunk's piece count, its pieces'
            boundaries as element offsets (columns 1 + p and 2 + p: piece p's start and
            stop), then from column most + 2 the part each piece lies in.
        steps: int64 (steps, 3): send chunk, receive chunk, reduce (0 or 1).
        slots: int64 request slots: chunks x most pieces for sends, then 2 x most pieces for
            the double-buffered receives; MPI_REQUEST_NULL at the start.
        state: int64 (STATE_FIELDS): zeros at the start; kept between calls.
        params: int64 (PARAMS).
        flag, status: int32 and int64 scratch for MPI_Test.
    """
    comm, byte = params[P_COMM], params[P_BYTE]
    left, right, op = params[P_LEFT], params[P_RIGHT], params[P_OP]
    in_place, finalize = params[P_IN_PLACE] != 0, params[P_FINALIZE] != 0
    half = params[P_HALF]
    spin, yields, largest = params[P_SPIN], params[P_YIELD], params[P_LARGEST]
    item = scratch.itemsize
    dtype = scratch.dtype
    chunks = pieces.shape[0]
    most = (pieces.shape[1] - 2) // 2
    receive_base = chunks * most
    count = steps.shape[0]
    base = slots.ctypes.data
    if state[PC] == 0:  # the first chunk's sends
        first = steps[0, 0]
        for tag in range(pieces[first, 0]):
            start, stop = pieces[first, 1 + tag], pieces[first, 2 + tag]
            address = _at(parts, pieces, most, first, tag, start, item) if in_place else \
                source.ctypes.data + start * item
            code = _isend(address, (stop - start) * item, byte, right, tag, comm,
                          base + (first * most + tag) * SLOT_BYTES)
            if code != 0:
                state[ERROR] = code
                return -1
        state[PC] = 1
    while state[INDEX] < count:
        index = state[INDEX]
        has_next = index + 1 < count
        if state[PC] == 1:  # this step's receives (unless posted a step early)
            # a scatter-reduce receive is posted a step early
            target = index + 2 if has_next and steps[index + 1, 2] != 0 else index + 1
            while state[POSTED] < target:
                posting = state[POSTED]
                chunk = steps[posting, 1]
                side = posting % 2
                if not (steps[posting, 2] != 0 and in_place):
                    # into the buffer: first let this rank's earlier sends of the chunk finish
                    for tag in range(pieces[chunk, 0]):
                        slot = chunk * most + tag
                        event = _await(slots, slot, state, flag, status, spin, yields)
                        if event != READY:
                            return event
                chunk_start = pieces[chunk, 1]
                for tag in range(pieces[chunk, 0]):
                    start, stop = pieces[chunk, 1 + tag], pieces[chunk, 2 + tag]
                    if steps[posting, 2] != 0 and in_place:
                        address = scratch.ctypes.data + (side * largest + start - chunk_start) * item
                    else:
                        address = _at(parts, pieces, most, chunk, tag, start, item)
                    code = _irecv(address, (stop - start) * item, byte, left, tag, comm,
                                  base + (receive_base + side * most + tag) * SLOT_BYTES)
                    if code != 0:
                        state[ERROR] = code
                        return -1
                state[POSTED] = posting + 1
            state[PC] = 2
            state[TAG] = 0
        chunk = steps[index, 1]
        reduce = steps[index, 2] != 0
        owned_now = reduce and (not has_next or steps[index + 1, 2] == 0)
        side = index % 2
        chunk_start = pieces[chunk, 1]
        while state[TAG] < pieces[chunk, 0]:
            tag = state[TAG]
            start, stop = pieces[chunk, 1 + tag], pieces[chunk, 2 + tag]
            if state[PC] == 2:  # the piece's receive, then its reduction
                slot = receive_base + side * most + tag
                event = _await(slots, slot, state, flag, status, spin, yields)
                if event != READY:
                    return event
                if reduce:
                    into = numba.carray(_pointer(_at(parts, pieces, most, chunk, tag, start,
                                                     item)), stop - start, dtype)
                    if in_place:
                        offset = side * largest + start - chunk_start
                        _combine(into, scratch[offset:offset + stop - start], op, half)
                    else:
                        _combine(into, source[start:stop], op, half)
                state[PC] = 3
                if owned_now and finalize:
                    state[FIN_START] = start
                    state[FIN_STOP] = stop
                    return FINALIZE
            if has_next:  # forward the piece
                code = _isend(_at(parts, pieces, most, chunk, tag, start, item),
                              (stop - start) * item, byte, right, tag, comm,
                              base + (chunk * most + tag) * SLOT_BYTES)
                if code != 0:
                    state[ERROR] = code
                    return -1
            state[TAG] = tag + 1
            state[PC] = 2
        state[INDEX] = index + 1
        state[PC] = 1
    # every send finished before the buffer is handed back
    for slot in range(receive_base):
        event = _await(slots, slot, state, flag, status, spin, yields)
        if event != READY:
            return event
    return DONE
