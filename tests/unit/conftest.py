"""Unit tests run numba.cuda kernels in numba's CUDA simulator (tests/gpu has the real thing).

Set before anything imports numba; a run that sets NUMBA_ENABLE_CUDASIM itself keeps its value.
"""

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
