"""How a fetch's bytes reach the caller, one module per way (client.py's
module doc describes each):

  shm        host memory, mode "export" over the data socket: copy-on-write
             maps of the daemon's segments, under a lease
  grpc       host memory over Read streams into private buffers
  push       host memory the client allocates (a memfd) and the daemon fills
  cuda_push  a CUDA VMM allocation of this process that the daemon fills
  cuda_export  the daemon's own device buffer of the shard, imported read-only
  zero_copy  CUDA tensors over the read-only shm maps, read by the GPU in place
  pull       the shm maps copied to the GPU by this process

Each module's collect(client, resp, lease, target) turns a FetchResponse
into a ShardHandle; on an error the caller (Client.fetch) ends the lease.
"""
from dataclasses import dataclass
from typing import Optional

from .. import _cuda
from ..v1 import weightd_pb2 as pb
from . import cuda_export, cuda_push, grpc, pull, push, shm, zero_copy


@dataclass(frozen=True)
class Target:
    """Where and how one fetch delivers its bytes: Client.fetch's
    arguments, checked."""
    request: pb.FetchRequest  # as sent (push handles refresh with it)
    mode: str  # "export", "push", "pull" or "zero-copy"
    transport: str  # "shm" or "grpc"
    device: Optional[int] = None  # a CUDA ordinal, or None: host memory
    timeout: Optional[float] = None  # each RPC's; a push's reply (None: by size)
    populate: bool = False  # host shm: fill the page tables now
    pin: bool = True  # pull: pin the shard's pages first
    zero_copy_path: Optional[str] = None  # zero-copy: _cuda.zero_copy_path(device)


def target(request, mode, transport, device, timeout, populate, pin):
    """The Target of a checked fetch. On a device (-1: torch's current one),
    first checks that this process has it (torch with CUDA) and, for
    zero-copy, how the device can read host pages in place: Error
    FAILED_PRECONDITION before any lease is taken when it cannot."""
    zero_copy_path = None
    if device is not None:
        _, device = _cuda.require_torch_cuda(device)
        if mode == "zero-copy":
            zero_copy_path = _cuda.zero_copy_path(device)
    return Target(request=request, mode=mode, transport=transport, device=device,
                  timeout=timeout, populate=populate, pin=pin, zero_copy_path=zero_copy_path)


_ON_DEVICE = {"push": cuda_push, "export": cuda_export, "zero-copy": zero_copy, "pull": pull}


def collect(client, resp, lease, target):
    """The ShardHandle of FetchResponse `resp` (lease: its lease), delivered
    as `target` says."""
    if target.device is not None:
        way = _ON_DEVICE[target.mode]
    elif target.mode == "push":
        way = push
    else:
        way = shm if target.transport == "shm" else grpc
    return way.collect(client, resp, lease, target)
