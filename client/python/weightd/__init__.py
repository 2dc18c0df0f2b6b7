"""weightd: Python client of the weightd weight-serving daemon.

    import weightd
    client = weightd.Client(socket="/run/weightd/w.sock")
    client.health()
    with client.fetch("llama", world=8, rank=3, dtype="bf16") as h:
        sd = h.state_dict()          # {name: torch.Tensor}, zero-copy (shm)
        weightd.load_into_module(model_on_meta, h)

Every failure raises weightd.Error (.code is the canonical name, e.g.
"NOT_FOUND"; .message the text). See client.py for transport and lifetime
details, _dtypes.py for dtype mapping (BF16 -> uint16 in NumPy mode;
F8_E4M3/F8_E5M2 -> uint8 on torch without float8 dtypes).
"""
from .errors import Error
try:
    from ._version import __version__  # written by the build (the CMake project version)
except ImportError:  # the source tree, not built
    __version__ = "0+unknown"
from ._types import (AdapterInfo, GenerationEvent, LoadProgress, ModelInfo, TensorInfo,
                     TensorMeta)
from .client import Client
from .handle import ShardHandle, WatchStream
from .publish import PublishResult, PublishSession
from .torch_utils import load_into_module

__all__ = ["__version__", "Client", "Error", "ShardHandle", "TensorMeta", "TensorInfo", "ModelInfo",
           "LoadProgress", "GenerationEvent", "AdapterInfo", "WatchStream", "PublishSession",
           "PublishResult",
           "load_into_module"]
