"""Element types: proto enum <-> safetensors names <-> NumPy / PyTorch dtypes.

Documented deviations (no native type available):
  * BF16 in NumPy mode is a uint16 view of the raw bits.
  * F8_E4M3 / F8_E5M2 become uint8 tensors/arrays of the same shape holding
    the raw bits, unless the installed torch has torch.float8_e4m3fn /
    torch.float8_e5m2, which are used then.
"""
import numpy as np

from .errors import Error

# safetensors name -> (proto enum value, bytes per element, NumPy dtype)
_ROWS = {
    "F64": (1, 8, np.float64),
    "F32": (2, 4, np.float32),
    "F16": (3, 2, np.float16),
    "BF16": (4, 2, np.uint16),
    "I64": (5, 8, np.int64),
    "I32": (6, 4, np.int32),
    "I16": (7, 2, np.int16),
    "I8": (8, 1, np.int8),
    "U8": (9, 1, np.uint8),
    "BOOL": (10, 1, np.bool_),
    "F8_E4M3": (11, 1, np.uint8),
    "F8_E5M2": (12, 1, np.uint8),
}
_BY_ENUM = {v[0]: k for k, v in _ROWS.items()}

# request spellings (case-insensitive) -> safetensors name
_ALIASES = {
    "F64": "F64", "FLOAT64": "F64", "DOUBLE": "F64",
    "F32": "F32", "FLOAT32": "F32", "FLOAT": "F32", "FP32": "F32",
    "F16": "F16", "FLOAT16": "F16", "HALF": "F16", "FP16": "F16",
    "BF16": "BF16", "BFLOAT16": "BF16",
    "I64": "I64", "INT64": "I64", "I32": "I32", "INT32": "I32",
    "I16": "I16", "INT16": "I16", "I8": "I8", "INT8": "I8",
    "U8": "U8", "UINT8": "U8", "BOOL": "BOOL",
    "F8_E4M3": "F8_E4M3", "F8E4M3": "F8_E4M3", "FLOAT8_E4M3FN": "F8_E4M3",
    "F8_E5M2": "F8_E5M2", "F8E5M2": "F8_E5M2", "FLOAT8_E5M2": "F8_E5M2",
}


def name_of_enum(value):
    try:
        return _BY_ENUM[int(value)]
    except KeyError:
        raise Error("INTERNAL", "daemon sent unknown dtype %d" % int(value)) from None


def enum_of_name(name):
    return _ROWS[name][0]


def itemsize(name):
    return _ROWS[name][1]


def numpy_dtype(name):
    return np.dtype(_ROWS[name][2])


def torch_or_none():
    """torch when it is installed, else None (the client then hands out
    NumPy arrays)."""
    try:
        import torch
        return torch
    except ImportError:
        return None


def torch_dtype(name):
    """The torch dtype a tensor of `name` is given as (see module doc)."""
    import torch
    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
        "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
        "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", torch.uint8),
        "F8_E5M2": getattr(torch, "float8_e5m2", torch.uint8),
    }
    return table[name]


def parse_request_dtype(dtype):
    """None/"keep" -> None; else the safetensors name. Accepts weightctl's
    spellings ("f32", "bf16", "f8_e4m3", ...), safetensors names, and torch
    or NumPy dtypes."""
    if dtype is None:
        return None
    if not isinstance(dtype, str):
        text = str(dtype)
        if text.startswith("torch."):
            text = text[len("torch."):]
        else:
            try:
                text = np.dtype(dtype).name
            except TypeError:
                raise Error("INVALID_ARGUMENT", "unknown dtype %r" % (dtype,)) from None
    else:
        text = dtype
    upper = text.strip().upper()
    if upper in ("", "KEEP"):
        return None
    try:
        return _ALIASES[upper]
    except KeyError:
        raise Error("INVALID_ARGUMENT", "unknown dtype \"%s\" (expected keep|f32|f16|bf16|f64|"
                    "f8_e4m3|f8_e5m2|i64|i32|i16|i8|u8|bool)" % text) from None
