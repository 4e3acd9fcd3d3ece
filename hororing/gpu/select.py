"""One GPU per rank: pick ``local_rank % device_count`` unless the user already chose."""

import sys


def select_device(local_rank, enabled=True):
    """Make GPU ``local_rank % count`` current for cupy and numba (whichever are imported).

    Does nothing when no GPU library is imported, when the process sees no GPU, when
    ``enabled`` is false (``Config.select_device``: HORORING_SELECT_DEVICE=0), or when the
    user already made a device current through torch (``torch.cuda.set_device``). Returns
    the selected device index, or None.
    """
    if not enabled:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return None  # the user chose (torch.cuda.set_device or a tensor already on a GPU)
    cupy = sys.modules.get("cupy")
    numba_cuda = sys.modules.get("numba.cuda")
    count = 0
    if cupy is not None:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # cupy without a driver: no GPU here
            count = 0
    elif numba_cuda is not None and numba_cuda.is_available():
        count = len(numba_cuda.gpus)
    if count == 0:
        return None
    device = local_rank % count
    if cupy is not None:
        cupy.cuda.Device(device).use()
    if numba_cuda is not None and numba_cuda.is_available():
        numba_cuda.select_device(device)
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    return device
