// The machine's limit for loading a checkpoint: read whole files with
// pread() into fresh anonymous memory, in page-aligned chunks on N threads,
// the way a loader without any daemon could at best. Also evicts files from
// the page cache (for cold loads) and reports how much of them is resident.
//
//   pread_bench [--threads N] [--chunk-bytes B] [--memory fresh|populated|memfd] FILE...
//       one JSON line: bytes, seconds, GB/s. fresh: anonymous memory, faulted
//       in by pread; populated: MAP_POPULATE'd first (time included); memfd:
//       a fresh memfd (the shared memory the daemon must hand out), each
//       chunk populated with MADV_POPULATE_WRITE just before its pread
//   pread_bench --evict FILE...     fdatasync + posix_fadvise(DONTNEED) each
//                                   file, then print the fraction still cached
//   pread_bench --resident FILE...  print the fraction of the files in cache
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"

namespace {

constexpr uint64_t kPage = 4096;

struct File {
  std::string path;
  int fd = -1;
  uint64_t size = 0;
};

bool OpenAll(const std::vector<std::string>& paths, std::vector<File>* files) {
  for (const std::string& p : paths) {
    File f;
    f.path = p;
    f.fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (f.fd < 0 || ::fstat(f.fd, &st) != 0) {
      std::fprintf(stderr, "error: NOT_FOUND: %s: %s\n", p.c_str(), std::strerror(errno));
      return false;
    }
    f.size = static_cast<uint64_t>(st.st_size);
    files->push_back(f);
  }
  return true;
}

// Pages of the files in the page cache, over all pages.
double ResidentFraction(const std::vector<File>& files) {
  uint64_t pages = 0, resident = 0;
  for (const File& f : files) {
    if (f.size == 0) continue;
    void* addr = ::mmap(nullptr, f.size, PROT_READ, MAP_SHARED, f.fd, 0);
    if (addr == MAP_FAILED) continue;
    uint64_t n = (f.size + kPage - 1) / kPage;
    std::vector<unsigned char> vec(n);
    if (::mincore(addr, f.size, vec.data()) == 0) {
      for (unsigned char c : vec) resident += c & 1;
      pages += n;
    }
    ::munmap(addr, f.size);
  }
  return pages == 0 ? 0.0 : static_cast<double>(resident) / static_cast<double>(pages);
}

int Evict(const std::vector<File>& files) {
  for (const File& f : files) {
    ::fdatasync(f.fd);  // dirty pages cannot be dropped
    ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  std::printf("{\"evicted\": %zu, \"resident_fraction\": %.4f}\n", files.size(),
              ResidentFraction(files));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  uint64_t chunk = 16ull << 20;
  std::string memory = "fresh";
  std::string mode = "read";
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--evict" || a == "--resident") {
      mode = a.substr(2);
    } else if ((a == "--threads" || a == "--chunk-bytes" || a == "--memory") && i + 1 < argc) {
      std::string v = argv[++i];
      bool ok = true;
      if (a == "--threads") ok = absl::SimpleAtoi(v, &threads) && threads >= 1;
      if (a == "--chunk-bytes") ok = absl::SimpleAtoi(v, &chunk) && chunk >= kPage;
      if (a == "--memory") {
        memory = v;
        ok = v == "fresh" || v == "populated" || v == "memfd";
      }
      if (!ok) {
        std::fprintf(stderr, "error: INVALID_ARGUMENT: bad value for %s: %s\n", a.c_str(),
                     v.c_str());
        return 2;
      }
    } else {
      paths.push_back(a);
    }
  }
  std::vector<File> files;
  if (paths.empty() || !OpenAll(paths, &files)) return 2;
  if (mode == "evict") return Evict(files);
  if (mode == "resident") {
    std::printf("{\"resident_fraction\": %.4f}\n", ResidentFraction(files));
    return 0;
  }
  chunk = chunk / kPage * kPage;

  struct Chunk {
    int fd;
    uint64_t offset, length;
    uint8_t* dest;
  };
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::pair<uint8_t*, uint64_t>> maps;
  std::vector<Chunk> chunks;
  uint64_t total = 0;
  for (const File& f : files) {
    uint64_t len = (f.size + kPage - 1) / kPage * kPage;
    if (len == 0) continue;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | (memory == "populated" ? MAP_POPULATE : 0);
    int mfd = -1;
    if (memory == "memfd") {
      mfd = ::memfd_create("pread_bench", MFD_CLOEXEC);
      if (mfd < 0 || ::ftruncate(mfd, static_cast<off_t>(len)) != 0) {
        std::fprintf(stderr, "error: RESOURCE_EXHAUSTED: memfd of %llu bytes\n",
                     static_cast<unsigned long long>(len));
        return 1;
      }
      flags = MAP_SHARED;
    }
    void* addr = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, flags, mfd, 0);
    if (mfd >= 0) ::close(mfd);  // the mapping keeps it
    if (addr == MAP_FAILED) {
      std::fprintf(stderr, "error: RESOURCE_EXHAUSTED: mmap %llu bytes\n",
                   static_cast<unsigned long long>(len));
      return 1;
    }
    maps.emplace_back(static_cast<uint8_t*>(addr), len);
    for (uint64_t off = 0; off < f.size; off += chunk) {
      chunks.push_back(
          {f.fd, off, std::min(chunk, f.size - off), static_cast<uint8_t*>(addr) + off});
    }
    total += f.size;
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < chunks.size(); i = next.fetch_add(1)) {
      const Chunk& c = chunks[i];
#ifdef MADV_POPULATE_WRITE
      if (memory == "memfd") {
        ::madvise(c.dest, (c.length + kPage - 1) / kPage * kPage, MADV_POPULATE_WRITE);
      }
#endif
      uint64_t done = 0;
      while (done < c.length) {
        ssize_t n = ::pread(c.fd, c.dest + done, c.length - done,
                            static_cast<off_t>(c.offset + done));
        if (n <= 0) {
          if (n < 0 && errno == EINTR) continue;
          failed = true;
          return;
        }
        done += static_cast<uint64_t>(n);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (failed) {
    std::fprintf(stderr, "error: DATA_LOSS: short read\n");
    return 1;
  }
  uint64_t sum = 0;  // keep the reads observable
  for (auto& [addr, len] : maps) {
    sum += addr[0];
    ::munmap(addr, len);
  }
  std::printf("{\"bytes\": %llu, \"seconds\": %.6f, \"gb_per_s\": %.3f, \"threads\": %d, "
              "\"memory\": \"%s\", \"chunk_bytes\": %llu, \"checksum\": %llu}\n",
              static_cast<unsigned long long>(total), s, static_cast<double>(total) / s / 1e9,
              threads, memory.c_str(), static_cast<unsigned long long>(chunk),
              static_cast<unsigned long long>(sum));
  return 0;
}
