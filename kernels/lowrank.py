"""The products of a low-rank approximation (PowerSGD) on host arrays, through torch's BLAS
where the process has imported torch.

For an n x m matrix M and thin factors P (n x r) and Q (m x r), r = 1..4: P = M Q, Q = Mᵀ P
and M ≈ P Qᵀ. numpy runs the last as a loop over outer products when r is small and the
second as a transposed GEMM: on one core here, for a 4096 x 4096 float32 matrix, numpy took
9.6-19 ms for P Qᵀ and 9.6 ms for Mᵀ P at rank 4; torch 2.7-3.7 and 3.9 (as (Pᵀ M)ᵀ). Each
function writes ``out`` and falls back to numpy where torch is not imported or an array is
not a plain C-contiguous float32/float64 one. torch is never imported here.
"""

import sys

import numpy as np

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _tensors(*arrays):
    """torch tensors over ``arrays``' memory, or None where one cannot be used."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "from_numpy"):
        return None
    dtype = arrays[0].dtype
    for array in arrays:
        if (type(array) is not np.ndarray or array.dtype != dtype or dtype not in _FLOATS
                or not array.flags.c_contiguous or not array.flags.writeable):
            return None
    return [torch.from_numpy(array) for array in arrays]


def project(matrix, q, out):
    """``out`` = ``matrix`` @ ``q`` (n x m times m x r)."""
    tensors = _tensors(matrix, q, out)
    if tensors is None:
        np.matmul(matrix, q, out=out)
        return out
    sys.modules["torch"].mm(tensors[0], tensors[1], out=tensors[2])
    return out


def project_back(matrix, p, out):
    """``out`` = ``matrix``ᵀ @ ``p`` (m x r), computed as (pᵀ matrix)ᵀ."""
    tensors = _tensors(matrix, p, out)
    if tensors is None:
        np.matmul(matrix.T, p, out=out)
        return out
    tensors[2].copy_(sys.modules["torch"].mm(tensors[1].t(), tensors[0]).t())
    return out


def expand(p, q, out):
    """``out`` = ``p`` @ ``q``ᵀ (n x r times r x m)."""
    tensors = _tensors(p, q, out)
    if tensors is None:
        np.matmul(p, q.T, out=out)
        return out
    sys.modules["torch"].mm(tensors[0], tensors[1].t(), out=tensors[2])
    return out
