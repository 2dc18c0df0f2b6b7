"""The client's arguments turned into the daemon's requests: placements,
profiles, readers, load sources, and Client.fetch's mesh, transport, mode
and device, checked (INVALID_ARGUMENT naming the argument) before anything
is sent. Pure functions."""
import json
import os
import re

from . import _cuda, _dtypes
from .errors import Error
from .v1 import weightd_pb2 as pb

TRANSPORTS = {"shm": pb.SHM, "grpc": pb.GRPC}
GPU_MODES = ("push", "pull", "zero-copy", "export")


def request(cls, **fields):
    """cls(**fields), dropping fields this proto lacks when they are unset."""
    known = cls.DESCRIPTOR.fields_by_name
    for k in [k for k in fields if k not in known]:
        if fields[k]:
            raise Error("UNIMPLEMENTED", "%s has no field %s in this client's proto"
                        % (cls.DESCRIPTOR.name, k))
        del fields[k]
    return cls(**fields)


def load_source(source):
    """LoadRequest.source for "auto", "storage" or "peers"."""
    sources = {"auto": pb.LOAD_SOURCE_AUTO, "storage": pb.LOAD_SOURCE_STORAGE,
               "peers": pb.LOAD_SOURCE_PEERS}
    if source not in sources:
        raise Error("INVALID_ARGUMENT", f"source: expected auto, storage or peers, got {source!r}")
    return sources[source]


def readers(readers):
    """readers= as a list of "uid:N"/"gid:N"/"token:NAME"/"cn:NAME" strings
    (a comma-separated string works too)."""
    if readers is None:
        return []
    if isinstance(readers, str):
        readers = [readers]
    return [str(r) for r in readers]


def adapter_refs(adapters):
    """Client.apply's stack, [name | (name, strength)], as AdapterRefs."""
    refs = []
    for a in adapters:
        name, strength = (a, 1.0) if isinstance(a, str) else a
        refs.append(pb.AdapterRef(name=name, strength=float(strength)))
    return refs


def parse_profile(profile):
    """dict -> JSON; str starting with '{' -> JSON text; else a file path."""
    if profile is None:
        return ""
    if isinstance(profile, dict):
        return json.dumps(profile)
    if isinstance(profile, bytes):
        return profile.decode()
    if isinstance(profile, str) and profile.lstrip().startswith("{"):
        return profile
    try:
        with open(os.fspath(profile), "r") as f:
            return f.read()
    except OSError as e:
        raise Error("INVALID_ARGUMENT", "cannot read profile %s: %s" % (profile, e)) from None


def parse_placement(p):
    if isinstance(p, bool):
        raise Error("INVALID_ARGUMENT", "invalid placement %r" % (p,))
    if isinstance(p, int):
        if p < -1:
            raise Error("INVALID_ARGUMENT", "invalid placement %d (-1 = replicate)" % p)
        return p
    if not isinstance(p, str):
        # torch DTensor placements: Shard(dim) has .dim; Replicate has none.
        if type(p).__name__ == "Replicate":
            return -1
        dim = getattr(p, "dim", None)
        if type(p).__name__ == "Shard" and isinstance(dim, int):
            return dim
        raise Error("INVALID_ARGUMENT", "invalid placement %r" % (p,))
    t = p.strip()
    if t in ("R", "Replicate()"):
        return -1
    m = re.fullmatch(r"S(\d+)|Shard\((\d+)\)", t)
    if not m:
        raise Error("INVALID_ARGUMENT", "invalid placement \"%s\" (expected R, S<dim>, "
                    "Replicate() or Shard(<dim>))" % p)
    return int(m.group(1) or m.group(2))


def parse_placements(placements):
    if placements is None:
        return None
    if isinstance(placements, str):
        if not placements.strip():
            raise Error("INVALID_ARGUMENT", "empty placement list")
        placements = placements.split(",")
    return [parse_placement(p) for p in placements]


def mesh_of(world, rank, mesh, coord):
    """fetch's world/rank or mesh/coord as ([mesh dims], [coordinate])."""
    if mesh is not None or coord is not None:
        if world is not None or rank is not None:
            raise Error("INVALID_ARGUMENT", "give either world/rank or mesh/coord, not both")
        if mesh is None or coord is None:
            raise Error("INVALID_ARGUMENT", "mesh and coord go together")
        if isinstance(mesh, str):
            mesh = [int(x) for x in mesh.lower().split("x")]
        if isinstance(coord, str):
            coord = [int(x) for x in coord.split(",")]
        return [int(x) for x in mesh], [int(x) for x in coord]
    return [1 if world is None else int(world)], [0 if rank is None else int(rank)]


def placements_of(placements, dims):
    """fetch's placements (None = the profile's / defaults), one per mesh dim."""
    pl = parse_placements(placements)
    if pl is not None and len(pl) != dims:
        raise Error("INVALID_ARGUMENT", "placements %r have %d entries but the mesh has %d "
                    "dims" % (placements, len(pl), dims))
    return pl


def fetch_target(transport, device, mode):
    """fetch's transport, device and mode, checked together: (mode, device)
    with device a CUDA ordinal (-1: torch's current one) or None (host
    memory), and mode "push" by default on a GPU, "export" in host memory."""
    if transport not in TRANSPORTS:
        raise Error("INVALID_ARGUMENT", "transport: expected shm or grpc, got %r"
                    % (transport,))
    dev = _cuda.parse_device(device)
    if dev is not None:
        if mode is None:
            mode = "push"
        if mode not in GPU_MODES:
            raise Error("INVALID_ARGUMENT", "mode: expected push, pull, zero-copy or export, "
                        "got %r" % (mode,))
        if transport != "shm":
            raise Error("INVALID_ARGUMENT", "a fetch into a GPU (mode \"%s\") needs "
                        "transport \"shm\" (a local daemon), not %r" % (mode, transport))
    elif mode in ("pull", "zero-copy"):
        raise Error("INVALID_ARGUMENT", "mode \"%s\" is for a GPU: give device=\"cuda:N\""
                    % mode)
    if mode not in (None, "export", "push", "pull", "zero-copy"):
        raise Error("INVALID_ARGUMENT", "mode: expected export, push, pull or zero-copy, got %r"
                    % (mode,))
    if mode == "push" and transport != "shm":
        raise Error("INVALID_ARGUMENT", "mode \"push\" needs transport \"shm\" (the daemon "
                    "writes into a memfd passed over its data socket), not %r" % (transport,))
    return mode or "export", dev


def fetch_request(model, mesh_shape, mesh_coord, pl, dtype, generation, changed_since, names,
                  transport, mode, device, cast_on_push, merge_on_push):
    """The FetchRequest of a checked fetch (pl from placements_of; mode and
    device from fetch_target). Casts (and merges) are deferred to the
    writer when the daemon writes the bytes into this fetch's own
    destination (fetch's cast_on_push / merge_on_push)."""
    dt = _dtypes.parse_request_dtype(dtype)
    req = pb.FetchRequest(
        model=model, generation=int(generation), mesh_shape=mesh_shape, coord=mesh_coord,
        dtype=_dtypes.enum_of_name(dt) if dt else pb.DTYPE_UNSPECIFIED,
        names=list(names or ()), transport=TRANSPORTS[transport],
        changed_since=int(changed_since),
        defer_casts=((mode == "push" or (mode == "export" and device is not None)) and
                     bool(cast_on_push)))
    if req.defer_casts:
        req.defer_merges = bool(device is not None if merge_on_push is None else merge_on_push)
    if pl is not None:
        req.placements.extend(pb.Placement(shard_dim=d) for d in pl)
    return req
