"""The values the client hands out (ModelInfo, TensorMeta, ...), and their
conversion from the daemon's messages. Plain frozen dataclasses: no state,
no locks."""
from dataclasses import dataclass, field
from typing import Tuple

from . import _dtypes


@dataclass(frozen=True)
class TensorInfo:
    """A served tensor of a model (Client.info)."""
    name: str
    dtype: str  # safetensors spelling: "F32", "BF16", "F8_E4M3", ...
    shape: Tuple[int, ...]
    digest: bytes  # 16-byte content identity (XXH3-128) at the current generation
    sources: Tuple[str, ...] = ()  # checkpoint tensors it is made of
    patched_by: Tuple[str, ...] = ()  # adapters of the current stack touching it


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    generation: int
    tensor_count: int
    total_bytes: int
    files: Tuple[str, ...] = ()
    tensors: Tuple[TensorInfo, ...] = ()  # filled by info(), empty in list()
    adapters: Tuple[str, ...] = ()  # current stack, "name:strength"
    report: Tuple[str, ...] = ()  # profile report lines
    readers: Tuple[str, ...] = ()  # who may read it ("uid:N", ...); empty = public
    # The checkpoint's segments by the pages behind them (--huge-pages).
    segment_bytes_4k: int = 0
    segment_bytes_thp: int = 0
    segment_bytes_hugetlb: int = 0
    # Identity of the current generation's weights (hex): a digest over
    # (served name, tensor digest) of every served tensor; the same on every
    # daemon serving the same checkpoint, profile and adapter stack.
    weights_id: str = ""


@dataclass(frozen=True)
class LoadProgress:
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    current_file: str
    # Where the bytes done came from: storage, and peers (their addresses).
    bytes_from_storage: int = 0
    bytes_from_peers: int = 0
    peers: Tuple[str, ...] = ()
    done: bool = False  # the last report, sent once the model is loaded
    # Per entry of `peers`: what carried its bytes ("grpc", "ucx", "grpc+ucx").
    peer_transports: Tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a fetched shard: the rank's local piece."""
    name: str
    dtype: str  # served dtype, safetensors spelling
    shape: Tuple[int, ...]  # local shape
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    digest: bytes  # XXH3-128 of the served bytes (b"": cast by a push, fetch(cast_on_push))
    segment: int
    offset: int
    length: int

    @property
    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GenerationEvent:
    model: str
    generation: int
    adapters: Tuple[str, ...] = field(default_factory=tuple)
    weights_id: str = ""  # as ModelInfo.weights_id


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    format: str
    tensor_count: int
    bytes: int = 0
    ignored: Tuple[str, ...] = ()
    readers: Tuple[str, ...] = ()  # empty = public


def opt(msg, name, default=()):
    """A field that older daemons' protos lack."""
    v = getattr(msg, name, default)
    return tuple(v) if not isinstance(v, (int, float, str, bytes)) else v


def adapter_info(a):
    return AdapterInfo(a.name, a.path, a.format, a.tensor_count, opt(a, "bytes", 0),
                       opt(a, "ignored"), opt(a, "readers"))


def model_info(m):
    return ModelInfo(
        name=m.name, path=m.path, generation=m.generation, tensor_count=m.tensor_count,
        total_bytes=m.total_bytes, files=tuple(m.files),
        tensors=tuple(TensorInfo(t.name, _dtypes.name_of_enum(t.dtype), tuple(t.shape),
                                 bytes(t.digest), opt(t, "sources"), opt(t, "patched_by"))
                      for t in m.tensors),
        adapters=opt(m, "adapters"), report=opt(m, "report"), readers=opt(m, "readers"),
        segment_bytes_4k=opt(m, "segment_bytes_4k", 0),
        segment_bytes_thp=opt(m, "segment_bytes_thp", 0),
        segment_bytes_hugetlb=opt(m, "segment_bytes_hugetlb", 0),
        weights_id=opt(m, "weights_id", ""))


def load_progress(msg):
    """A LoadResponse stream message as LoadProgress."""
    return LoadProgress(msg.bytes_done, msg.bytes_total, msg.tensors_done, msg.tensors_total,
                        msg.current_file, msg.bytes_from_storage, msg.bytes_from_peers,
                        tuple(msg.peers), msg.done, tuple(msg.peer_transports))


def generation_event(ev):
    return GenerationEvent(ev.model, ev.generation, tuple(ev.adapters), opt(ev, "weights_id", ""))


def tensor_meta(t):
    """A FetchResponse tensor as TensorMeta (unchecked)."""
    return TensorMeta(
        name=t.name, dtype=_dtypes.name_of_enum(t.dtype), shape=tuple(t.shape),
        global_shape=tuple(t.global_shape), global_offset=tuple(t.global_offset),
        digest=bytes(t.digest), segment=t.segment, offset=t.offset, length=t.length)


def peer_info(p):
    """A PeersResponse peer as Client.peers describes it."""
    return {"address": p.address, "reachable": p.reachable, "error": p.error,
            "last_seen": p.last_seen_unix_ms / 1000.0 if p.last_seen_unix_ms else None,
            "models": [{"name": m.name, "generation": m.generation,
                        "weights_id": m.weights_id} for m in p.models]}


def stats(resp):
    """A StatsResponse as Client.stats's dict."""
    out = {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}
    out["peer_transfers"] = {t.peer: {"bytes": t.bytes, "failures": t.failures}
                             for t in resp.peer_transfers}
    # {peer: {transport: {bytes, seconds, failures}}} (--peer-transport)
    transports = {}
    for t in resp.peer_transports:
        transports.setdefault(t.peer, {})[t.transport] = {
            "bytes": t.bytes, "seconds": t.seconds, "failures": t.failures}
    out["peer_transports"] = transports
    return out
