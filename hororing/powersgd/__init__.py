"""PowerSGD as a gradient communication hook (``hook.py``), on host arrays or torch tensors
(``arrays.py``)."""

from .hook import PowerSGD

__all__ = ["PowerSGD"]
