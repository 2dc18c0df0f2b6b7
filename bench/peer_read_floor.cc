// The loopback gRPC floor for peer replication (bench/replication_bench.py):
// reads the data section of a checkpoint file held by a daemon through its
// ReadCheckpoint RPC — the same call, ranges and streams a loading peer
// uses — into memory faulted in beforehand, and does nothing else with the
// bytes (no copy into segments, no page faults, no digests). What a load
// from peers adds on top of this is the daemon's own work.
//
//   peer_read_floor --peer HOST:PORT --file PATH [--token TOKEN] [--streams 4]
//                   [--chunk-bytes 16777216] [--repeats 3]
// PATH: the single .safetensors file the daemon loaded (its key is computed
// from its header, as the daemon does; its first bytes are the sample that
// picks the copy). TOKEN: a bearer token the daemon's --fleet-members admits.
// Prints one JSON line.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "common/digest.h"
#include "common/file_opener.h"
#include "server/store/peer_source.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace {

int Die(const std::string& why) {
  std::fprintf(stderr, "peer_read_floor: %s\n", why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string peer, file, token;
  uint64_t streams = 4, chunk = 16ull << 20, repeats = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], v = argv[i + 1];
    if (flag == "--peer") {
      peer = v;
    } else if (flag == "--file") {
      file = v;
    } else if (flag == "--token") {
      token = v;
    } else if (flag == "--streams" && absl::SimpleAtoi(v, &streams) && streams > 0) {
    } else if (flag == "--chunk-bytes" && absl::SimpleAtoi(v, &chunk) && chunk > 0) {
    } else if (flag == "--repeats" && absl::SimpleAtoi(v, &repeats) && repeats > 0) {
    } else {
      return Die("bad flag " + flag);
    }
  }
  if (peer.empty() || file.empty()) return Die("--peer and --file are required");
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || ::fstat(fd, &st) != 0) return Die("cannot open " + file);
  uint64_t header_len = 0;
  if (::pread(fd, &header_len, 8, 0) != 8) return Die("short file");
  if (header_len > static_cast<uint64_t>(st.st_size) - 8 || header_len > (100u << 20)) {
    return Die("not a safetensors file: " + file);
  }
  std::string header(8 + header_len, '\0');
  if (::pread(fd, header.data(), header.size(), 0) != static_cast<ssize_t>(header.size())) {
    return Die("short header");
  }
  // The sample a holder picks its copy by: the data section's first bytes.
  std::string sample(std::min<uint64_t>(64 << 10, static_cast<uint64_t>(st.st_size) -
                                                      header.size()),
                     '\0');
  if (::pread(fd, sample.data(), sample.size(), static_cast<off_t>(header.size())) !=
      static_cast<ssize_t>(sample.size())) {
    return Die("short data");
  }
  ::close(fd);
  weightd::CheckpointFileId id{weightd::Basename(file), static_cast<uint64_t>(st.st_size),
                               weightd::DigestBytes(header.data(), header.size())};
  const weightd::Digest key = weightd::CheckpointKey({id});
  const uint64_t data_len = static_cast<uint64_t>(st.st_size) - header.size();
  if (data_len == 0) return Die("no tensor bytes in " + file);

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto stub = weightd::v1::Models::NewStub(
      grpc::CreateCustomChannel(peer, grpc::InsecureChannelCredentials(), args));
  // The copy the daemon holds (FindCheckpoint), which every range names.
  std::string copy;
  {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    weightd::v1::FindCheckpointRequest req;
    req.set_key(std::string(key.View()));
    weightd::v1::CheckpointRange* r = req.add_samples();
    r->set_file(0);
    r->set_offset(0);
    r->set_length(sample.size());
    req.add_sample_digests(
        std::string(weightd::DigestBytes(sample.data(), sample.size()).View()));
    weightd::v1::FindCheckpointResponse resp;
    grpc::Status s = stub->FindCheckpoint(&ctx, req, &resp);
    if (!s.ok()) return Die("FindCheckpoint: " + s.error_message());
    copy = resp.copy();
  }
  auto* dest = static_cast<uint8_t*>(::mmap(nullptr, data_len, PROT_READ | PROT_WRITE,
                                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
  if (dest == MAP_FAILED) return Die("mmap");
  std::memset(dest, 1, data_len);  // every page resident before the clock starts
  std::vector<double> gbps;
  for (uint64_t r = 0; r < repeats; ++r) {
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (uint64_t s = 0; s < streams; ++s) {
      threads.emplace_back([&] {
        while (true) {
          const uint64_t off = next.fetch_add(chunk);
          if (off >= data_len) return;
          const uint64_t len = std::min(chunk, data_len - off);
          grpc::ClientContext ctx;
          if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
          weightd::v1::ReadCheckpointRequest req;
          req.set_key(std::string(key.View()));
          req.set_copy(copy);
          req.mutable_range()->set_file(0);
          req.mutable_range()->set_offset(off);
          req.mutable_range()->set_length(len);
          auto reader = stub->ReadCheckpoint(&ctx, req);
          weightd::v1::ReadChunk msg;
          uint64_t pos = 0;
          while (reader->Read(&msg)) {
            if (msg.data().size() > len - pos) {  // more than asked: fails below
              ctx.TryCancel();
              pos = len + 1;
              break;
            }
            std::memcpy(dest + off + pos, msg.data().data(), msg.data().size());
            pos += msg.data().size();
          }
          grpc::Status status = reader->Finish();
          if (!status.ok() || pos != len) {
            std::fprintf(stderr, "peer_read_floor: range %llu: %s\n",
                         static_cast<unsigned long long>(off), status.error_message().c_str());
            failed = true;
            return;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    if (failed) return 1;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbps.push_back(static_cast<double>(data_len) / secs / 1e9);
  }
  std::string runs;
  for (double g : gbps) runs += (runs.empty() ? "" : ", ") + std::to_string(g);
  std::printf("{\"bytes\": %llu, \"streams\": %llu, \"chunk_bytes\": %llu, \"gbps\": [%s]}\n",
              static_cast<unsigned long long>(data_len), static_cast<unsigned long long>(streams),
              static_cast<unsigned long long>(chunk), runs.c_str());
  return 0;
}
