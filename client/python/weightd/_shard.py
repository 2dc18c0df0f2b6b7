"""Shard boxes (docs/DESIGN.md §2.1, common/shard.h ChunkOf / PlanShard): which piece
of a global tensor a rank of a device mesh holds under its placements
(torch.chunk's rule), and that piece's contiguous byte runs in the global
row-major tensor. Pure functions.

A sharded publish uses them to say where each rank's local shard goes; the
daemon serves a fetch by the same rule."""
import numpy as np

from .errors import Error


def chunk_of(n, parts, index):
    """torch.chunk's piece `index` of `n` rows in `parts` pieces: (start, length)."""
    size = -(-n // parts) if parts > 0 else 0
    start = min(index * size, n)
    return start, min(size, n - start)


def local_box(shape, mesh, coord, placements):
    """The (offset, shape) of this rank's local shard (docs/DESIGN.md §2.1), and
    whether this rank writes it: of the ranks that hold the same piece (they
    differ only on mesh dims that replicate it), the one at coordinate 0."""
    offset = [0] * len(shape)
    size = list(shape)
    writes = True
    for m, p in enumerate(placements):
        if p < 0 or not shape:
            writes = writes and coord[m] == 0
            continue
        if p >= len(shape):
            raise Error("INVALID_ARGUMENT", "Shard(%d) of a tensor with %d dims" % (p, len(shape)))
        start, length = chunk_of(size[p], mesh[m], coord[m])
        offset[p] += start
        size[p] = length
    return offset, size, writes


def box_runs(shape, offset, size, itemsize):
    """(global byte offset, length) of each contiguous run of the box, in
    the box's row-major order."""
    nd = len(shape)
    if nd == 0:
        return [(0, itemsize)]
    if any(s == 0 for s in size):
        return []
    strides = [itemsize] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # Dims q.. form one run: q is the innermost dim the box does not cover whole.
    q = nd - 1
    while q > 0 and size[q] == shape[q] and offset[q] == 0:
        q -= 1
    run = size[q] * strides[q]
    outer = [range(offset[d], offset[d] + size[d]) for d in range(q)]
    runs = []
    for idx in (np.ndindex(*[len(r) for r in outer]) if q > 0 else [()]):
        at = offset[q] * strides[q]
        for d in range(q):
            at += (offset[d] + idx[d]) * strides[d]
        runs.append((at, run))
    return runs
