"""Host memory over gRPC (transport "grpc"): each segment's tensor ranges,
merged where closer than the policy's READ_MERGE_GAP, read with Read
streams into private buffers that hold the lease; the tensors are views of
those buffers."""
import grpc

from .. import _policy
from ..errors import Error, from_grpc
from ..handle import ShardHandle
from ..v1 import weightd_pb2 as pb
from . import common


class _Buffer(bytearray):
    """Bytes streamed over the grpc transport; holds the lease alive."""


def _merged_ranges(metas, segment):
    """[lo, hi) byte ranges of `segment` covering its non-empty tensors,
    coalesced across gaps of at most READ_MERGE_GAP."""
    ranges = sorted((m.offset, m.offset + m.length) for m in metas
                    if m.segment == segment and m.length)
    merged = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1] + _policy.READ_MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def collect(client, resp, lease, target):
    metas = common.metas(resp)
    pieces = {}
    for seg_index in range(len(resp.segment_sizes)):
        bufs = [(lo, hi, _read(client._shards, lease, seg_index, lo, hi - lo, target.timeout))
                for lo, hi in _merged_ranges(metas, seg_index)]
        for m in metas:
            if m.segment != seg_index or not m.length:
                continue
            for lo, hi, buf in bufs:
                if lo <= m.offset and m.offset + m.length <= hi:
                    pieces[m.name] = (buf, m.offset - lo)
                    break
    for m in metas:
        pieces.setdefault(m.name, None)
    return common.identified(resp, ShardHandle(lease, resp.generation, "grpc", metas, pieces))


def _read(shards, lease, segment, offset, length, timeout):
    """`length` bytes of `segment` at `offset`, in order, into a _Buffer."""
    buf = _Buffer(length)
    buf._lease = lease
    view = memoryview(buf)
    got = 0
    call = shards.Read(pb.ReadRequest(lease_id=lease.lease_id, token=lease.token,
                                      segment=segment, offset=offset, length=length),
                       timeout=timeout)
    try:
        for chunk in call:
            n = len(chunk.data)
            if chunk.offset != got or n > length - got:
                call.cancel()
                raise Error("INTERNAL", "daemon sent an out-of-order or oversized chunk")
            view[got:got + n] = chunk.data
            got += n
    except grpc.RpcError as e:
        raise from_grpc(e, "reading segment %d" % segment) from None
    finally:
        view.release()
    if got != length:
        raise Error("DATA_LOSS", "segment %d: got %d of %d bytes" % (segment, got, length))
    return buf
