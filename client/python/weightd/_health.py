"""The gRPC health check (grpc.health.v1.Health/Check) without generated
stubs: the request is empty and the response's one field, `status` (field
1, a varint), is read here.

Why not protoc's stubs of proto/grpc/health/v1/health.proto: generated
Python modules register their messages in protobuf's default descriptor
pool, and grpcio-health-checking (grpc_health.v1.health_pb2, which servers
embedding this client commonly import) registers the same grpc.health.v1
names from another file: whichever is imported second fails with "Couldn't
build proto file into descriptor pool". A stub under its proto's own path
(grpc/health/v1) would also shadow grpcio's `grpc` package. Pure functions.
"""
SERVING = 1
_SERVING_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _read_varint(data, i):
    shift = value = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _decode_health_response(data):
    """grpc.health.v1.HealthCheckResponse -> its `status` (field 1, varint)."""
    status, i = 0, 0
    while i < len(data):
        key, i = _read_varint(data, i)
        fnum, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _read_varint(data, i)
            if fnum == 1:
                status = v
        elif wt == 1:
            i += 8
        elif wt == 2:
            n, i = _read_varint(data, i)
            i += n
        elif wt == 5:
            i += 4
        else:
            raise ValueError("bad wire type %d" % wt)
    return status


def check_method(channel):
    """Health/Check on `channel`: called with None, returns the status."""
    return channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda _: b"",
                               response_deserializer=_decode_health_response)


def status_name(status):
    return _SERVING_NAMES.get(status, status)
