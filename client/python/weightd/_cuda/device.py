"""CUDA devices as the client names them (fetch's device=, GPU UUIDs as the
daemon names them, torch's view of the process's devices), and torch CUDA
tensors over device memory without a copy (tensor_from_ptr, view_bytes).
torch is imported only by the functions that need it. Pure functions.
"""
import ctypes

from ..errors import Error
from .libcuda import CUuuid, driver


def parse_device(device):
    """fetch(device=...): None/"cpu" -> None (host memory); an int N,
    "cuda:N" or torch.device("cuda", N) -> N; "cuda" / torch.device("cuda")
    -> -1 (torch's current device). Error INVALID_ARGUMENT otherwise."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise Error("INVALID_ARGUMENT", "invalid device %r" % (device,))
    if isinstance(device, int):
        if device < 0:
            raise Error("INVALID_ARGUMENT", "invalid device %d (a CUDA device index is >= 0)"
                        % device)
        return device
    if isinstance(device, str):
        text = device.strip().lower()
        kind, _, index = text.partition(":")
        if _ and not index.isdigit():
            raise Error("INVALID_ARGUMENT", "invalid device \"%s\" (expected \"cuda:N\")"
                        % device)
        index = int(index) if _ else None
    elif hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        kind, index = str(device.type), device.index
    else:
        raise Error("INVALID_ARGUMENT", "invalid device %r (expected \"cuda:N\", an int or a "
                    "torch.device)" % (device,))
    if kind == "cpu" and index in (None, 0):
        return None
    if kind != "cuda":
        raise Error("INVALID_ARGUMENT", "invalid device %r: only CUDA devices (or \"cpu\") are "
                    "supported" % (device,))
    return -1 if index is None else int(index)


def require_torch_cuda(index):
    """torch, once it is known to have CUDA device `index` (-1: its current
    device; then resolved). Returns (torch, index). FAILED_PRECONDITION
    without torch or CUDA in this process; INVALID_ARGUMENT for an index
    past the devices it sees."""
    try:
        import torch
    except ImportError:
        raise Error("FAILED_PRECONDITION", "device=cuda:%s needs PyTorch with CUDA: no CUDA "
                    "device in this process (torch is not installed)"
                    % ("" if index < 0 else index)) from None
    if not torch.cuda.is_available():
        raise Error("FAILED_PRECONDITION", "no CUDA device in this process (torch %s, built "
                    "for CUDA %s, torch.cuda.is_available() is False): a fetch into a GPU "
                    "needs one" % (torch.__version__, torch.version.cuda))
    n = torch.cuda.device_count()
    if index < 0:
        index = torch.cuda.current_device()
    if index >= n:
        raise Error("INVALID_ARGUMENT", "device cuda:%d: this process sees %d CUDA device(s)"
                    % (index, n))
    return torch, index


def parse_gpu_uuid(value):
    """16 UUID bytes from "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (with or
    without the GPU-/MIG- prefix, any case), 16 bytes, or a sequence of 16
    ints. Error INVALID_ARGUMENT otherwise."""
    if isinstance(value, (bytes, bytearray)) and len(value) == 16:
        return bytes(value)
    if isinstance(value, (list, tuple)) and len(value) == 16 and \
            all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return bytes(value)
    text = value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
    t = text.strip()
    for prefix in ("GPU-", "MIG-", "gpu-", "mig-"):
        if t.startswith(prefix):
            t = t[len(prefix):]
            break
    parts = t.split("-")
    if [len(p) for p in parts] != [8, 4, 4, 4, 12]:
        raise Error("INVALID_ARGUMENT", "not a GPU UUID: %r" % (text,))
    try:
        return bytes.fromhex("".join(parts))
    except ValueError:
        raise Error("INVALID_ARGUMENT", "not a GPU UUID: %r" % (text,)) from None


def format_gpu_uuid(b):
    """"GPU-xxxxxxxx-..." as nvidia-smi and the daemon print it."""
    h = bytes(b).hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


def gpu_uuid_bytes(device_index):
    """The 16-byte UUID of torch's CUDA device `device_index` (the daemon
    names GPUs by UUID): from torch's device properties, else the driver."""
    import torch
    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        try:
            return parse_gpu_uuid(str(uuid))
        except Error:
            raw = getattr(uuid, "bytes", None)
            if raw is not None:
                try:
                    return parse_gpu_uuid(bytes(bytearray(raw)))
                except (Error, TypeError, ValueError):
                    pass
    d = driver()
    dev = ctypes.c_int(-1)
    d.call("cuDeviceGet", ctypes.byref(dev), int(device_index))
    out = CUuuid()
    d.call("cuDeviceGetUuid_v2", ctypes.byref(out), dev.value)
    return bytes(out.bytes)


class _DeviceArray:
    """Hands torch a device range through __cuda_array_interface__ (v3) and
    keeps `owner` alive: torch holds this object until the storage made from
    it dies."""

    def __init__(self, ptr, nbytes, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (int(nbytes),), "typestr": "|u1", "data": (int(ptr), False),
            "version": 3, "strides": None}


def tensor_from_ptr(ptr, nbytes, dtype, shape, device_index, owner):
    """A torch CUDA tensor of `dtype` and `shape` over the `nbytes` bytes at
    device address `ptr` on device `device_index`, without a copy; `owner`
    (e.g. the VmmAllocation) lives as long as the tensor's storage. bf16,
    fp8 and bool have no typestr of their own: the range is handed over as
    uint8 and viewed as `dtype`."""
    import torch
    nbytes = int(nbytes)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cuda:%d" % device_index)
    with torch.cuda.device(device_index):
        raw = torch.as_tensor(_DeviceArray(ptr, nbytes, owner),
                              device="cuda:%d" % device_index)
    if raw.data_ptr() != int(ptr) or raw.device.index != device_index or \
            raw.dtype != torch.uint8 or raw.numel() != nbytes:
        raise Error("INTERNAL", "torch did not wrap device memory 0x%x in place (got 0x%x on "
                    "%s)" % (int(ptr), raw.data_ptr(), raw.device))
    return view_bytes(raw, 0, nbytes, dtype, shape)


def view_bytes(raw, offset, length, dtype, shape):
    """[offset, offset+length) of the 1-D uint8 CUDA tensor `raw` as a tensor
    of `dtype` and `shape` (a view: the same memory). length 0: a new empty
    tensor of that shape on the same device."""
    import torch
    if int(length) == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    piece = raw.narrow(0, int(offset), int(length))
    if dtype != torch.uint8:
        piece = piece.view(dtype)
    return piece.view(tuple(shape))
