"""The fleet RPCs' arithmetic as a peer does it (server/store/peer_source.h):
checkpoint keys, sample digests, copy ids and tensor digests of safetensors
files, computed here with python3-xxhash, for the tests that play a peer (one
without rights, a lying one)."""
import json
import os
import struct

import xxhash


def xxh(data):
    """XXH3-128, as the daemon's Digest bytes."""
    return xxhash.xxh3_128(data).digest()


class StFile:
    """One safetensors file: its name (in the index), size, header bytes,
    data section, and tensors as (name, begin, end) in data-offset order
    (ties by name): the order of a holder's digests."""

    def __init__(self, path, name=None):
        with open(path, "rb") as f:
            blob = f.read()
        (n,) = struct.unpack("<Q", blob[:8])
        self.name = name or os.path.basename(path)
        self.size = len(blob)
        self.header = blob[:8 + n]
        self.data = blob[8 + n:]
        header = json.loads(blob[8:8 + n])
        header.pop("__metadata__", None)
        self.tensors = sorted(((e["data_offsets"][0], k, e["data_offsets"][1])
                               for k, e in header.items()))
        self.tensors = [(k, b, e) for b, k, e in self.tensors]

    def tensor_digests(self, data=None):
        data = self.data if data is None else data
        return b"".join(xxh(data[b:e]) for _, b, e in self.tensors)


def checkpoint_key(files):
    """FindCheckpointRequest.key of files [StFile] in checkpoint order."""
    h = xxhash.xxh3_128()
    for f in files:
        name = f.name.encode()
        h.update(struct.pack("<Q", len(name)) + name + struct.pack("<Q", f.size) + xxh(f.header))
    return h.digest()


def copy_id(files):
    """Checkpoint::copy_id: the tensors' digests in name order."""
    named = sorted((k.encode(), xxh(f.data[b:e])) for f in files for k, b, e in f.tensors)
    return xxh(b"".join(d for _, d in named))


def find_request(pb, files, samples):
    """A FindCheckpointRequest for `files` with `samples` [(file, offset,
    length)] and their true digests."""
    return pb.FindCheckpointRequest(
        key=checkpoint_key(files),
        samples=[pb.CheckpointRange(file=i, offset=o, length=n) for i, o, n in samples],
        sample_digests=[xxh(files[i].data[o:o + n]) for i, o, n in samples])
