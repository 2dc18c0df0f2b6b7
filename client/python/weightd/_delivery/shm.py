"""Host memory over the data socket (mode "export", transport "shm"): the
lease attached on the data socket, each segment mapped copy-on-write; the
tensors are views of those maps, and each map holds the lease."""
from ..handle import ShardHandle
from . import common


def collect(client, resp, lease, target):
    metas = common.metas(resp)
    maps = common.attach_and_map(client, resp, lease, private=True)
    pieces = {}
    for m in metas:
        pieces[m.name] = (maps[m.segment], m.offset) if m.length else None
        if m.length and target.populate:
            common.populate(maps[m.segment], m.offset, m.length)
    return common.identified(resp, ShardHandle(lease, resp.generation, "shm", metas, pieces))
