#!/usr/bin/python3
"""The kernel's floor under a warm shm fetch: how long this machine takes to
map already-resident shared memory into a fresh mapping (page tables for 4 KiB
pages, or 2 MiB ones where shmem THP is on), which every worker pays for the
bytes of its shard. Prints one line per method and the host's shmem THP mode.

  bench/populate_floor.py [MiB]   (default 512)
"""
import mmap
import os
import sys
import time

import numpy as np

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+


def main():
    size = (int(sys.argv[1]) if len(sys.argv) > 1 else 512) << 20
    fd = os.memfd_create("weightd-populate-floor")
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as m:  # make every page resident
        m.write(b"\1" * size)

    def best_of(fn, rounds=3):
        best = float("inf")
        for _ in range(rounds):
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
                t0 = time.perf_counter()
                fn(mm)
                best = min(best, time.perf_counter() - t0)
        return best

    def touch(mm):
        a = np.frombuffer(mm, dtype=np.uint8)
        a[::4096].sum()
        del a

    for label, fn in (("MADV_POPULATE_READ", lambda mm: mm.madvise(MADV_POPULATE_READ)),
                      ("touch one byte per 4 KiB page", touch)):
        s = best_of(fn)
        print("%-30s %7.1f ms for %d MiB  (%.1f GB/s)" % (label, s * 1e3, size >> 20,
                                                          size / s / 1e9))
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            print("shmem THP:", f.read().strip())
    except OSError:
        print("shmem THP: unknown")


if __name__ == "__main__":
    main()
