"""A rank's share of a tensor as DCP stores shards: boxes of the tensor's own shape.

A sharded optimizer holds, of each parameter's state, a run of the parameter's elements in
row-major order (its chunk of a flat vector). A checkpoint keyed by parameter names keeps each
state tensor in the parameter's shape, so the run is written as the boxes (offsets, sizes)
that tile it: at most two per dimension. DCP keeps each box as a chunk, and reads any other
tiling back (it reshards at load); ``Boxes`` is what the planners (``planners.py``) look the
chunks up in.
"""

import math


def tile(shape, low, high):
    """The boxes ``[(offsets, sizes), ...]`` whose elements are exactly those at row-major
    positions ``low`` up to ``high`` of a tensor of ``shape``, in that order (each box's
    elements are consecutive, so a box is a view of the run reshaped)."""
    shape = tuple(shape)
    if low >= high:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((low,), (high - low,))]
    inner = math.prod(shape[1:])
    first, last = low // inner, (high - 1) // inner
    boxes = []

    def row(index, start, stop):  # part of one row: the boxes of the rest of the shape
        return [((index,) + offsets, (1,) + sizes)
                for offsets, sizes in tile(shape[1:], start, stop)]

    if first == last:
        return row(first, low - first * inner, high - first * inner)
    if low % inner:
        boxes += row(first, low % inner, inner)
        first += 1
    whole = high // inner  # rows before this are whole
    if whole > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (whole - first,) + shape[1:]))
    if high % inner:
        boxes += row(whole, 0, high % inner)
    return boxes


class Boxes:
    """This rank's share of one tensor of ``shape``: ``pieces`` are ``(low, run)`` pairs, the
    1-D tensor ``run`` holding the row-major elements from ``low`` on (views into the
    optimizer's state, so a load fills the state in place)."""

    def __init__(self, shape, dtype, pieces):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.chunks = {}  # offsets -> (sizes, the box as a view of its run)
        for low, run in pieces:
            position = 0
            for offsets, sizes in tile(self.shape, low, low + run.numel()):
                count = math.prod(sizes)
                self.chunks[tuple(offsets)] = (
                    tuple(sizes), run[position:position + count].view(sizes))
                position += count

    def size(self):
        import torch
        return torch.Size(self.shape)

    def shard(self, offsets):
        """The box at ``offsets`` (a view into the state)."""
        return self.chunks[tuple(offsets)][1]

    def __create_write_items__(self, fqn, _):
        import torch
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata,
                                                           MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)
        return [WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                           sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=self.dtype),
                size=torch.Size(self.shape)))
            for offsets, (sizes, _) in self.chunks.items()]

    def __create_chunk_list__(self):
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for offsets, (sizes, _) in self.chunks.items()]

    def staged(self, copy):
        """The same boxes over copies of their views (``copy(tensor)`` makes one)."""
        clone = Boxes.__new__(Boxes)
        clone.shape, clone.dtype = self.shape, self.dtype
        clone.chunks = {offsets: (sizes, copy(view))
                        for offsets, (sizes, view) in self.chunks.items()}
        return clone
