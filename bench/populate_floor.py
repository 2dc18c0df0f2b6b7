#!/usr/bin/python3
"""The kernel's floor under a warm shm fetch: how long this machine takes to
map already-resident shared memory into a fresh mapping (page tables), which
every worker pays for the bytes of its shard — with 4 KiB pages (a plain
memfd; 2 MiB where shmem THP is on) and with 2 MiB hugetlb pages (a memfd
with MFD_HUGETLB, from the host's pool; skipped with the reason when the pool
is short). Prints one line per page size and method, and the host's shmem
THP mode; bench/suite.py's "hugepages" figure calls floor().

  bench/populate_floor.py [MiB]   (default 512)
"""
import mmap
import os
import sys
import time

import numpy as np

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
HUGE = 2 << 20


def floor(size, hugetlb=False, rounds=3):
    """{method: best seconds} to populate / touch a fresh read-only map of
    `size` resident bytes (hugetlb: 2 MiB pages; OSError when the pool is short)."""
    flags = os.MFD_HUGETLB if hugetlb else 0
    if hugetlb:
        size = -(-size // HUGE) * HUGE
    fd = os.memfd_create("weightd-populate-floor", flags)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:  # make every page resident
            a = np.frombuffer(m, dtype=np.uint8)
            a[:] = 1
            del a

        def best_of(fn):
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

        return {"populate_read": best_of(lambda mm: mm.madvise(MADV_POPULATE_READ)),
                "touch_4k": best_of(touch)}
    finally:
        os.close(fd)


def shmem_thp():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def main():
    size = (int(sys.argv[1]) if len(sys.argv) > 1 else 512) << 20
    for pages, huge in (("4 KiB", False), ("2 MiB hugetlb", True)):
        try:
            res = floor(size, hugetlb=huge)
        except OSError as e:
            print("%-14s skipped: %s (the 2 MiB pool: vm.nr_hugepages)" % (pages, e))
            continue
        for label, key in (("MADV_POPULATE_READ", "populate_read"),
                           ("touch one byte per 4 KiB", "touch_4k")):
            s = res[key]
            print("%-14s %-26s %7.2f ms for %d MiB  (%.1f GB/s)" % (
                pages, label, s * 1e3, size >> 20, size / s / 1e9))
    print("shmem THP:", shmem_thp())


if __name__ == "__main__":
    main()
