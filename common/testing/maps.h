// Test support: what /proc/self/maps says about this process's own
// mappings, for tests (and the fake CUDA plugin) that check how memory is
// mapped. Header-only, so any test binary or test module can use it
// without a library.
#ifndef WEIGHTD_COMMON_TESTING_MAPS_H_
#define WEIGHTD_COMMON_TESTING_MAPS_H_

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

namespace weightd {

// The permissions of the mappings covering [addr, addr + size) as
// /proc/self/maps shows them ("rw-s"), "" where a byte is not mapped, or
// "mixed" where they differ. With the default size: the mapping holding
// `addr`.
inline std::string MappingPerms(const void* addr, size_t size = 1) {
  const auto lo = reinterpret_cast<uintptr_t>(addr);
  const uintptr_t hi = lo + size;
  std::ifstream maps("/proc/self/maps");
  std::string line, perms;
  uintptr_t covered = lo;
  while (std::getline(maps, line) && covered < hi) {
    unsigned long a = 0, b = 0;
    char p[5] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &a, &b, p) != 3) continue;
    if (b <= covered || a > covered) continue;
    if (!perms.empty() && perms != p) return "mixed";
    perms = p;
    covered = b;
  }
  return covered >= hi ? perms : "";
}

}  // namespace weightd

#endif  // WEIGHTD_COMMON_TESTING_MAPS_H_
