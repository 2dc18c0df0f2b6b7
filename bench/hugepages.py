"""A hugetlb pool for one bench run (root): N more 2 MiB pages while the
run lasts, given back at its end whatever happens."""
import contextlib

NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextlib.contextmanager
def pool(pages, log=print):
    """Adds `pages` 2 MiB pages to vm.nr_hugepages (nothing for 0); yields
    how many the kernel gave."""
    if not pages:
        yield 0
        return
    with open(NR_HUGEPAGES) as f:
        old = int(f.read())
    try:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(old + pages))
        with open(NR_HUGEPAGES) as f:
            got = int(f.read()) - old
        log("huge pages: asked for %d more 2 MiB pages, got %d" % (pages, got))
        yield got
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(old))
        log("huge pages: vm.nr_hugepages back to %d" % old)
