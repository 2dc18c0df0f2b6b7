// A C++ program's side of test_dlpack.py: fetches with the C++ client and
// hands each tensor out as a DLPack DLManagedTensor* (weightd::ToDLPack),
// for torch.utils.dlpack.from_dlpack to take in the same process. Loaded
// with ctypes by a subprocess that imports no gRPC of its own.
#include <cstring>
#include <memory>
#include <string>

#include "client/weightd_client.h"

namespace {

struct Probe {
  std::unique_ptr<weightd::Client> client;
  std::shared_ptr<const weightd::ShardSet> set;
};

void Say(const absl::Status& s, char* err, int errlen) {
  if (err != nullptr && errlen > 0) std::snprintf(err, errlen, "%s", s.ToString().c_str());
}

}  // namespace

extern "C" {

// A fetch of `model` (rank of world, dtype "keep"/"f32"/...; transport
// "shm" or "push"); null with `err` filled on failure.
void* weightd_probe_fetch(const char* socket, const char* model, int world, int rank,
                          const char* dtype, const char* transport, char* err, int errlen) {
  weightd::ClientOptions co;
  co.socket = socket;
  auto client = weightd::Client::Connect(co);
  if (!client.ok()) return Say(client.status(), err, errlen), nullptr;
  weightd::FetchOptions fo;
  fo.model = model;
  fo.mesh = weightd::MeshCoord{{world}, {rank}};
  auto dt = weightd::ParseRequestDType(dtype);
  if (!dt.ok()) return Say(dt.status(), err, errlen), nullptr;
  fo.dtype = *dt;
  fo.transport = std::strcmp(transport, "push") == 0 ? weightd::Transport::kPush
                                                     : weightd::Transport::kShm;
  auto set = (*client)->Fetch(fo);
  if (!set.ok()) return Say(set.status(), err, errlen), nullptr;
  auto* p = new Probe{*std::move(client), std::shared_ptr<const weightd::ShardSet>(
                                              std::move(*set))};
  return p;
}

int weightd_probe_count(void* probe) {
  return static_cast<int>(static_cast<Probe*>(probe)->set->tensors().size());
}

const char* weightd_probe_name(void* probe, int i) {
  return static_cast<Probe*>(probe)->set->tensors()[i].name.c_str();
}

void* weightd_probe_dlpack(void* probe, int i, char* err, int errlen) {
  auto t = weightd::ToDLPack(static_cast<Probe*>(probe)->set, static_cast<size_t>(i));
  if (!t.ok()) return Say(t.status(), err, errlen), nullptr;
  return *t;
}

// Drops the probe's hold on the set (DLPack tensors handed out keep it).
void weightd_probe_free(void* probe) { delete static_cast<Probe*>(probe); }

// The daemon's open leases, or -1.
long weightd_probe_leases(const char* socket) {
  weightd::ClientOptions co;
  co.socket = socket;
  auto client = weightd::Client::Connect(co);
  if (!client.ok()) return -1;
  auto stats = (*client)->Stats();
  return stats.ok() ? static_cast<long>(stats->leases_open) : -1;
}
}
