// One benchmark rank: fetch this rank's shard of a model from weightd and
// make it ready to read (mapped, every page touched), then print one JSON
// line with the timings. Driven by bench/fetch_bench.py.
//   fetch_rank --socket PATH --model NAME --world W --rank R [--dtype D]
//              [--transport shm|grpc] [--repeat N]
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "client/weightd_client.h"

int main(int argc, char** argv) {
  weightd::ClientOptions copt;
  weightd::FetchOptions fopt;
  int64_t world = 1, rank = 0;
  int repeat = 1;
  std::string dtype = "keep";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string f = argv[i], v = argv[i + 1];
    if (f == "--socket") copt.socket = v;
    else if (f == "--model") fopt.model = v;
    else if (f == "--world") (void)absl::SimpleAtoi(v, &world);
    else if (f == "--rank") (void)absl::SimpleAtoi(v, &rank);
    else if (f == "--dtype") dtype = v;
    else if (f == "--repeat") (void)absl::SimpleAtoi(v, &repeat);
    else if (f == "--transport") fopt.transport = v == "grpc" ? weightd::Transport::kGrpc
                                                              : weightd::Transport::kShm;
  }
  fopt.mesh = weightd::MeshCoord{{world}, {rank}};
  auto d = weightd::ParseRequestDType(dtype);
  if (!d.ok()) return 2;
  fopt.dtype = *d;
  auto client = weightd::Client::Connect(copt);
  if (!client.ok()) return 1;
  for (int it = 0; it < repeat; ++it) {
    absl::Time t0 = absl::Now();
    auto set = (*client)->Fetch(fopt);
    if (!set.ok()) {
      std::fprintf(stderr, "error: %s\n", set.status().ToString().c_str());
      return 1;
    }
    absl::Time t1 = absl::Now();
    // Touch one byte per page: the shard is then truly ready to read.
    uint64_t sum = 0, bytes = 0;
    for (const weightd::TensorView& t : (*set)->tensors()) {
      for (uint64_t off = 0; off < t.length; off += 4096) sum += t.data[off];
      bytes += t.length;
    }
    absl::Time t2 = absl::Now();
    std::printf("{\"rank\": %lld, \"fetch_s\": %.6f, \"ready_s\": %.6f, \"bytes\": %llu, "
                "\"tensors\": %zu, \"checksum\": %llu}\n",
                static_cast<long long>(rank), absl::ToDoubleSeconds(t1 - t0),
                absl::ToDoubleSeconds(t2 - t0), static_cast<unsigned long long>(bytes),
                (*set)->tensors().size(), static_cast<unsigned long long>(sum));
    std::fflush(stdout);
  }
  return 0;
}
