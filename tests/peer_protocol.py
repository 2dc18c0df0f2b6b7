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


class HolderProxy:
    """A holder's control plane as a test plays it: a real gRPC server with
    the generated Models stubs in front of a real holder (`upstream`), which
    forwards List and FindCheckpoint with the fleet's `auth` metadata, so
    what it says about the asker's samples is true. A subclass sees (and may
    change) each FindCheckpoint answer in `on_find` and serves more methods
    through `handlers`; a holder refusal is passed on with its code."""

    def __init__(self, upstream, auth, workers=4):
        from concurrent import futures

        import grpc
        from weightd.v1 import weightd_pb2 as pb
        from weightd.v1 import weightd_pb2_grpc as pb_grpc
        self.grpc, self.pb, self.auth = grpc, pb, auth
        unlimited = -1  # a holder's answers and chunks may be large
        self.channel = grpc.insecure_channel(
            upstream, options=[("grpc.max_receive_message_length", unlimited)])
        self.stub = pb_grpc.ModelsStub(self.channel)
        self.server = grpc.server(futures.ThreadPoolExecutor(workers),
                                  options=[("grpc.max_send_message_length", unlimited)])
        handlers = {
            "List": grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: self.stub.List(req, metadata=auth),
                request_deserializer=pb.ListModelsRequest.FromString,
                response_serializer=pb.ListModelsResponse.SerializeToString),
            "FindCheckpoint": grpc.unary_unary_rpc_method_handler(
                self._find, request_deserializer=pb.FindCheckpointRequest.FromString,
                response_serializer=pb.FindCheckpointResponse.SerializeToString),
        }
        handlers.update(self.handlers())
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("weightd.v1.Models", handlers)])
        self.address = "127.0.0.1:%d" % self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def handlers(self):
        return {}

    def on_find(self, req, resp):
        return resp

    def _find(self, req, ctx):
        try:
            resp = self.stub.FindCheckpoint(req, metadata=self.auth)
        except self.grpc.RpcError as e:
            ctx.abort(e.code(), e.details())
        return self.on_find(req, resp)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.server.stop(0)
        self.channel.close()
