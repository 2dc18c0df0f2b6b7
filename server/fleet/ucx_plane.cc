// UcxPlane over UCX's UCP API (see the header for the protocol and why it
// is not one-sided). Only this file includes <ucp/api/ucp.h>.
#include "server/fleet/ucx_plane.h"

#include <poll.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <regex>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include <ucp/api/ucp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/base/log.h"

namespace weightd {
namespace {

constexpr unsigned kReadRequest = 41;  // loader -> holder: ReadRequest header, no data
constexpr unsigned kReadReply = 42;    // holder -> loader: ReadReply header, the bytes

struct ReadRequest {
  uint64_t request = 0;  // the loader's id of this read
  uint64_t grant = 0;
  uint8_t token[16] = {};
  uint64_t offset = 0;
  uint64_t length = 0;
};
struct ReadReply {
  uint64_t request = 0;
  int32_t code = 0;  // absl::StatusCode; 0: the bytes follow
  uint32_t reserved = 0;
};

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

// Compares two 16-byte tokens in time independent of where they differ.
int TokenDiffers(const char* a, const uint8_t* b) {
  uint8_t d = 0;
  for (int i = 0; i < 16; ++i) d |= static_cast<uint8_t>(a[i]) ^ b[i];
  return d;
}

// What a UCX print function writes, as a string.
template <typename Fn>
std::string Printed(Fn&& fn) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return "";
  fn(f);
  std::fclose(f);
  std::string out(buf, len);
  std::free(buf);
  return out;
}

// "tl/device" names in UCX's printout (resources of a context, lanes of an
// endpoint), in order, each once.
std::string TransportNames(const std::string& printed, const std::regex& re) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (std::sregex_iterator it(printed.begin(), printed.end(), re), end; it != end; ++it) {
    std::string n = (*it)[1].str();
    if (seen.insert(n).second) names.push_back(n);
  }
  return absl::StrJoin(names, ",");
}

}  // namespace

struct UcxPlane::Impl {
  struct Endpoint;
  // A loader's read in flight. Written by the progress thread; the caller
  // waits on `done`.
  struct Pending {
    uint64_t id = 0;
    std::string peer;
    uint8_t* dest = nullptr;
    uint64_t length = 0;
    void* recv = nullptr;  // the rendezvous receive, while one runs
    Endpoint* ep = nullptr;  // while the read is in its pending set
    bool finished = false;  // guarded by mu
    absl::Status status;    // guarded by mu
    absl::Mutex mu;
    absl::CondVar done;
  };
  struct Endpoint {
    ucp_ep_h ep = nullptr;
    std::string peer;
    bool failed = false;
    bool logged = false;
    std::set<uint64_t> pending;
    Impl* impl = nullptr;
  };
  struct Region {
    ucp_mem_h memh = nullptr;
    const uint8_t* base = nullptr;
    uint64_t size = 0;
    std::weak_ptr<const Segment> segment;
  };
  struct GrantEntry {
    uint64_t segment = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    std::string token;
  };
  // A reply being sent: holds the segment until UCX is done with it.
  struct Sending {
    SegmentPtr segment;
    ReadReply header;
    Impl* impl = nullptr;
  };

  // Set by Start, constant after.
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::string address;
  std::string transports;
  int efd = -1;
  std::thread progress;

  // Registrations and grants; shared with the segments' release hooks
  // (a hook after the plane stopped finds `alive` false). unmap_mu is
  // held around ucp_mem_unmap, so that ucp_cleanup never races one; mu is
  // taken under it, never the other way.
  absl::Mutex unmap_mu ABSL_ACQUIRED_BEFORE(mu);
  mutable absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::map<uint64_t, Region> regions ABSL_GUARDED_BY(mu);
  std::map<uint64_t, GrantEntry> grants ABSL_GUARDED_BY(mu);
  std::map<std::tuple<uint64_t, uint64_t, uint64_t>, uint64_t> grant_of ABSL_GUARDED_BY(mu);
  uint64_t next_grant ABSL_GUARDED_BY(mu) = 1;
  std::mt19937_64 rng ABSL_GUARDED_BY(mu){std::random_device{}()};
  uint64_t bytes_sent ABSL_GUARDED_BY(mu) = 0;
  uint64_t refused ABSL_GUARDED_BY(mu) = 0;
  std::map<std::string, uint64_t> bytes_by_peer ABSL_GUARDED_BY(mu);
  std::map<std::string, std::string> transport_by_peer ABSL_GUARDED_BY(mu);

  // Work for the progress thread.
  absl::Mutex queue_mu;
  std::deque<std::function<void()>> queue ABSL_GUARDED_BY(queue_mu);
  bool stopping ABSL_GUARDED_BY(queue_mu) = false;

  // Owned by the progress thread.
  std::map<std::string, std::unique_ptr<Endpoint>> endpoints;  // by worker address
  std::map<uint64_t, std::shared_ptr<Pending>> pending;
  uint64_t next_request = 1;

  void Post(std::function<void()> fn) {
    {
      absl::MutexLock lock(&queue_mu);
      queue.push_back(std::move(fn));
    }
    ucp_worker_signal(worker);
  }

  void Run();
  bool Drain();
  void Finish(const std::shared_ptr<Pending>& p, absl::Status s);
  void FailEndpoint(Endpoint* e, ucs_status_t why);
  Endpoint* EndpointFor(const std::string& peer, const std::string& worker_address,
                        absl::Status& error);
  void StartRead(const std::shared_ptr<Pending>& p, const std::string& worker_address,
                 const UcxGrant& grant, uint64_t offset);
  void Abandon(const std::shared_ptr<Pending>& p);
  void LogTransport(Endpoint* e);
  void Unregister(uint64_t segment_id);
  void Shutdown();

  static ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  void Refuse(ucp_ep_h reply_ep, uint64_t request, absl::StatusCode code);
};

void UcxPlane::Impl::Finish(const std::shared_ptr<Pending>& p, absl::Status s) {
  pending.erase(p->id);
  if (p->ep != nullptr) {
    p->ep->pending.erase(p->id);
    p->ep = nullptr;
  }
  absl::MutexLock lock(&p->mu);
  if (p->finished) return;
  p->finished = true;
  p->status = std::move(s);
  p->done.SignalAll();
}

bool UcxPlane::Impl::Drain() {
  std::deque<std::function<void()>> work;
  bool stop;
  {
    absl::MutexLock lock(&queue_mu);
    work.swap(queue);
    stop = stopping;
  }
  for (auto& fn : work) fn();
  return stop;
}

void UcxPlane::Impl::Run() {
  for (;;) {
    if (Drain()) break;
    while (ucp_worker_progress(worker) != 0) {
    }
    if (Drain()) break;
    const ucs_status_t s = ucp_worker_arm(worker);
    if (s == UCS_ERR_BUSY) continue;
    pollfd pfd{efd, POLLIN, 0};
    (void)::poll(&pfd, 1, 100);
  }
  Shutdown();
}

void UcxPlane::Impl::Shutdown() {
  // Every read waiting fails; endpoints close; then nothing is left that
  // a registration could serve.
  for (auto it = pending.begin(); it != pending.end();) {
    auto p = (it++)->second;
    if (p->recv != nullptr) {
      ucp_request_cancel(worker, p->recv);
    }
  }
  for (int i = 0; i < 100 && ucp_worker_progress(worker) != 0; ++i) {
  }
  while (!pending.empty()) {
    Finish(pending.begin()->second, absl::UnavailableError("the UCX data plane stopped"));
  }
  std::vector<void*> closing;
  for (auto& [addr, e] : endpoints) {
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(e->ep, &prm);
    if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
  }
  for (int i = 0; i < 1000 && !closing.empty(); ++i) {
    ucp_worker_progress(worker);
    for (auto it = closing.begin(); it != closing.end();) {
      if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
        ucp_request_free(*it);
        it = closing.erase(it);
      } else {
        ++it;
      }
    }
  }
  endpoints.clear();
}

void UcxPlane::Impl::FailEndpoint(Endpoint* e, ucs_status_t why) {
  if (e->failed) return;
  e->failed = true;
  LogEvent(LogLevel::kWarning, "ucx_endpoint_failed",
           {{"peer", e->peer}, {"error", UcsError(why)},
            {"action", "its reads fail; the next read connects again"}});
  const absl::Status s = absl::UnavailableError(
      absl::StrCat("UCX endpoint to peer ", e->peer, " failed: ", UcsError(why)));
  for (uint64_t id : std::set<uint64_t>(e->pending)) {
    auto it = pending.find(id);
    if (it == pending.end()) continue;
    std::shared_ptr<Pending> p = it->second;
    if (p->recv != nullptr) {
      ucp_request_cancel(worker, p->recv);  // its callback finishes it
    } else {
      Finish(p, s);
    }
  }
}

UcxPlane::Impl::Endpoint* UcxPlane::Impl::EndpointFor(const std::string& peer,
                                                      const std::string& worker_address,
                                                      absl::Status& error) {
  auto it = endpoints.find(worker_address);
  if (it != endpoints.end() && !it->second->failed) return it->second.get();
  if (it != endpoints.end()) {
    // Failed: closed (forced) once its reads are gone; a new one replaces it.
    if (!it->second->pending.empty()) {
      error = absl::UnavailableError(
          absl::StrCat("UCX endpoint to peer ", peer, " failed; reads still draining"));
      return nullptr;
    }
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(it->second->ep, &prm);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    endpoints.erase(it);
  }
  auto e = std::make_unique<Endpoint>();
  e->peer = peer;
  e->impl = this;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
    auto* ep = static_cast<Endpoint*>(arg);
    ep->impl->FailEndpoint(ep, status);
  };
  params.err_handler.arg = e.get();
  const ucs_status_t s = ucp_ep_create(worker, &params, &e->ep);
  if (s != UCS_OK) {
    error = absl::UnavailableError(
        absl::StrCat("UCX endpoint to peer ", peer, ": ", UcsError(s)));
    return nullptr;
  }
  Endpoint* raw = e.get();
  endpoints[worker_address] = std::move(e);
  return raw;
}

void UcxPlane::Impl::LogTransport(Endpoint* e) {
  if (e->logged) return;
  e->logged = true;
  static const std::regex kLane(R"(lane\[\d+\]:\s+\d+:([A-Za-z0-9_]+/[A-Za-z0-9_.:-]+))");
  std::string lanes = TransportNames(Printed([&](FILE* f) { ucp_ep_print_info(e->ep, f); }),
                                     kLane);
  if (lanes.empty()) lanes = "unknown";
  {
    absl::MutexLock lock(&mu);
    transport_by_peer[e->peer] = lanes;
  }
  LogEvent(LogLevel::kInfo, "ucx_endpoint", {{"peer", e->peer}, {"transports", lanes}});
}

void UcxPlane::Impl::StartRead(const std::shared_ptr<Pending>& p,
                               const std::string& worker_address, const UcxGrant& grant,
                               uint64_t offset) {
  absl::Status error;
  Endpoint* e = EndpointFor(p->peer, worker_address, error);
  if (e == nullptr) {
    Finish(p, error);
    return;
  }
  p->id = next_request++;
  pending[p->id] = p;
  e->pending.insert(p->id);
  p->ep = e;
  auto req = std::make_unique<ReadRequest>();
  req->request = p->id;
  req->grant = grant.id;
  std::memcpy(req->token, grant.token.data(), std::min<size_t>(16, grant.token.size()));
  req->offset = offset;
  req->length = p->length;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA;
  prm.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  prm.cb.send = [](void* request, ucs_status_t, void* user) {
    delete static_cast<ReadRequest*>(user);
    ucp_request_free(request);
  };
  prm.user_data = req.get();
  void* r = ucp_am_send_nbx(e->ep, kReadRequest, req.get(), sizeof(ReadRequest), nullptr, 0, &prm);
  if (UCS_PTR_IS_ERR(r)) {
    Finish(p, absl::UnavailableError(absl::StrCat("UCX request to peer ", p->peer, ": ",
                                                  UcsError(UCS_PTR_STATUS(r)))));
    return;
  }
  if (r != nullptr) (void)req.release();  // the callback deletes it
}

void UcxPlane::Impl::Abandon(const std::shared_ptr<Pending>& p) {
  // Past its deadline: a rendezvous receive is cancelled (its callback
  // finishes it); otherwise it finishes now and a late reply is dropped.
  if (pending.find(p->id) == pending.end()) return;
  if (p->recv != nullptr) {
    ucp_request_cancel(worker, p->recv);
    return;
  }
  Finish(p, absl::DeadlineExceededError(
                absl::StrCat("UCX read of ", p->length, " bytes from peer ", p->peer,
                             " did not finish in time")));
}

void UcxPlane::Impl::Refuse(ucp_ep_h reply_ep, uint64_t request, absl::StatusCode code) {
  {
    absl::MutexLock lock(&mu);
    ++refused;
  }
  auto s = std::make_unique<Sending>();
  s->header.request = request;
  s->header.code = static_cast<int32_t>(code);
  s->impl = this;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = [](void* request, ucs_status_t, void* user) {
    delete static_cast<Sending*>(user);
    ucp_request_free(request);
  };
  prm.user_data = s.get();
  void* r = ucp_am_send_nbx(reply_ep, kReadReply, &s->header, sizeof(ReadReply), nullptr, 0, &prm);
  if (UCS_PTR_IS_PTR(r)) (void)s.release();
}

ucs_status_t UcxPlane::Impl::OnRequest(void* arg, const void* header, size_t header_length,
                                       void*, size_t, const ucp_am_recv_param_t* param) {
  auto* impl = static_cast<Impl*>(arg);
  if (header_length != sizeof(ReadRequest) ||
      !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || param->reply_ep == nullptr) {
    return UCS_OK;  // not ours to answer
  }
  ReadRequest req;
  std::memcpy(&req, header, sizeof(req));
  auto s = std::make_unique<Sending>();
  s->header.request = req.request;
  s->impl = impl;
  const uint8_t* from = nullptr;
  ucp_mem_h memh = nullptr;
  absl::StatusCode refuse = absl::StatusCode::kOk;
  {
    absl::MutexLock lock(&impl->mu);
    auto g = impl->grants.find(req.grant);
    // A wrong token answers as an unknown grant: no oracle of grant ids.
    if (g == impl->grants.end() || g->second.token.size() != 16 ||
        TokenDiffers(g->second.token.data(), req.token) != 0) {
      refuse = absl::StatusCode::kNotFound;
    } else if (req.offset > g->second.length || req.length > g->second.length - req.offset) {
      refuse = absl::StatusCode::kInvalidArgument;
    } else {
      auto r = impl->regions.find(g->second.segment);
      if (r != impl->regions.end()) s->segment = r->second.segment.lock();
      if (s->segment == nullptr) {
        refuse = absl::StatusCode::kNotFound;  // going: its hook runs next
      } else {
        from = r->second.base + g->second.offset + req.offset;
        memh = r->second.memh;
        impl->bytes_sent += req.length;
      }
    }
  }
  if (refuse != absl::StatusCode::kOk) {
    impl->Refuse(param->reply_ep, req.request, refuse);
    return UCS_OK;
  }
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (memh != nullptr) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = memh;
  }
  prm.cb.send = [](void* request, ucs_status_t, void* user) {
    delete static_cast<Sending*>(user);
    ucp_request_free(request);
  };
  prm.user_data = s.get();
  void* r = ucp_am_send_nbx(param->reply_ep, kReadReply, &s->header, sizeof(ReadReply), from,
                            req.length, &prm);
  if (UCS_PTR_IS_PTR(r)) (void)s.release();
  return UCS_OK;
}

ucs_status_t UcxPlane::Impl::OnReply(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  auto* impl = static_cast<Impl*>(arg);
  if (header_length != sizeof(ReadReply)) return UCS_OK;
  ReadReply rep;
  std::memcpy(&rep, header, sizeof(rep));
  auto it = impl->pending.find(rep.request);
  if (it == impl->pending.end()) return UCS_OK;  // abandoned: dropped
  std::shared_ptr<Pending> p = it->second;
  if (p->ep != nullptr) impl->LogTransport(p->ep);
  if (rep.code != 0) {
    const auto code = static_cast<absl::StatusCode>(rep.code);
    impl->Finish(p, absl::Status(code, absl::StrCat(
                                           "peer ", p->peer, " refused the UCX read: ",
                                           code == absl::StatusCode::kNotFound
                                               ? "no such grant (the checkpoint went?)"
                                               : "outside the grant")));
    return UCS_OK;
  }
  if (length != p->length) {
    impl->Finish(p, absl::DataLossError(absl::StrCat("peer ", p->peer, " sent ", length,
                                                     " bytes over UCX for a read of ",
                                                     p->length)));
    return UCS_OK;
  }
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    std::memcpy(p->dest, data, length);
    {
      absl::MutexLock lock(&impl->mu);
      impl->bytes_by_peer[p->peer] += length;
    }
    impl->Finish(p, absl::OkStatus());
    return UCS_OK;
  }
  // Rendezvous: UCX moves the bytes straight into the destination.
  struct RecvCtx {
    Impl* impl;
    std::shared_ptr<Pending> p;
  };
  auto ctx = std::make_unique<RecvCtx>(RecvCtx{impl, p});
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user) {
    std::unique_ptr<RecvCtx> c(static_cast<RecvCtx*>(user));
    c->p->recv = nullptr;
    ucp_request_free(request);
    if (status == UCS_OK) {
      absl::MutexLock lock(&c->impl->mu);
      c->impl->bytes_by_peer[c->p->peer] += c->p->length;
    }
    c->impl->Finish(c->p, status == UCS_OK
                              ? absl::OkStatus()
                              : absl::UnavailableError(absl::StrCat(
                                    "UCX receive from peer ", c->p->peer, ": ",
                                    UcsError(status))));
  };
  prm.user_data = ctx.get();
  void* r = ucp_am_recv_data_nbx(impl->worker, data, p->dest, length, &prm);
  if (UCS_PTR_IS_ERR(r)) {
    impl->Finish(p, absl::UnavailableError(absl::StrCat(
                        "UCX receive from peer ", p->peer, ": ", UcsError(UCS_PTR_STATUS(r)))));
  } else if (r == nullptr) {
    {
      absl::MutexLock lock(&impl->mu);
      impl->bytes_by_peer[p->peer] += length;
    }
    impl->Finish(p, absl::OkStatus());
  } else {
    p->recv = r;
    (void)ctx.release();
  }
  return UCS_OK;
}

void UcxPlane::Impl::Unregister(uint64_t segment_id) {
  absl::MutexLock unmap(&unmap_mu);
  ucp_mem_h memh = nullptr;
  {
    absl::MutexLock lock(&mu);
    if (!alive) return;
    auto r = regions.find(segment_id);
    if (r == regions.end()) return;
    memh = r->second.memh;
    regions.erase(r);
    for (auto it = grants.begin(); it != grants.end();) {
      if (it->second.segment == segment_id) {
        grant_of.erase({segment_id, it->second.offset, it->second.length});
        it = grants.erase(it);
      } else {
        ++it;
      }
    }
  }
  // No reply is in flight from it (each holds the segment), and no new one
  // starts (its grants are gone): unmapped before its memory goes.
  if (memh != nullptr) ucp_mem_unmap(context, memh);
}

absl::StatusOr<std::unique_ptr<UcxPlane>> UcxPlane::Start() {
  // TCP's PUT writes wherever a connected process says: off unless the
  // operator set it. (ucp_config_modify does not reach the TCP transport's
  // table in UCX 1.13: "invalid configuration"; the environment does. Set
  // once, at start, before the threads that could read the environment.)
  static const bool put_off = [] { return ::setenv("UCX_TCP_PUT_ENABLE", "n", 0) == 0; }();
  (void)put_off;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("UCX config: ", UcsError(s)));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  auto impl = std::make_shared<Impl>();
  s = ucp_init(&params, config, &impl->context);
  ucp_config_release(config);
  if (s != UCS_OK) return absl::UnavailableError(absl::StrCat("UCX init: ", UcsError(s)));
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  wp.events = UCP_WAKEUP_RX | UCP_WAKEUP_TX;
  // The TCP transport lists the host's interfaces while the worker is
  // made; one that goes away meanwhile (a CNI plugin or a veth being moved)
  // fails it with "No such device": that alone is tried twice more.
  s = ucp_worker_create(impl->context, &wp, &impl->worker);
  for (int retry = 0; s == UCS_ERR_NO_DEVICE && retry < 2; ++retry) {
    LogEvent(LogLevel::kWarning, "ucx", {{"state", "retry"}, {"why", UcsError(s)}});
    absl::SleepFor(absl::Milliseconds(250));
    s = ucp_worker_create(impl->context, &wp, &impl->worker);
  }
  if (s != UCS_OK) {
    ucp_cleanup(impl->context);
    return absl::UnavailableError(absl::StrCat("UCX worker: ", UcsError(s)));
  }
  auto fail = [&](const std::string& what, ucs_status_t st) {
    ucp_worker_destroy(impl->worker);
    ucp_cleanup(impl->context);
    return absl::UnavailableError(absl::StrCat(what, ": ", UcsError(st)));
  };
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(impl->worker, &addr, &addr_len);
  if (s != UCS_OK) return fail("UCX worker address", s);
  impl->address.assign(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(impl->worker, addr);
  s = ucp_worker_get_efd(impl->worker, &impl->efd);
  if (s != UCS_OK) return fail("UCX worker event fd", s);
  for (auto [id, cb] : {std::pair<unsigned, ucp_am_recv_callback_t>{kReadRequest, &Impl::OnRequest},
                        {kReadReply, &Impl::OnReply}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = impl.get();
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    s = ucp_worker_set_am_recv_handler(impl->worker, &hp);
    if (s != UCS_OK) return fail("UCX active message handler", s);
  }
  static const std::regex kResource(R"(resource\s+\d+\s*:.*?\s([A-Za-z0-9_]+/[A-Za-z0-9_.:-]+))");
  impl->transports = TransportNames(
      Printed([&](FILE* f) { ucp_context_print_info(impl->context, f); }), kResource);
  if (impl->transports.empty()) return fail("UCX found no transport", UCS_ERR_UNREACHABLE);
  Impl* raw = impl.get();
  impl->progress = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<UcxPlane>(new UcxPlane(std::move(impl)));
}

UcxPlane::UcxPlane(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

UcxPlane::~UcxPlane() {
  {
    absl::MutexLock lock(&impl_->queue_mu);
    impl_->stopping = true;
  }
  ucp_worker_signal(impl_->worker);
  impl_->progress.join();
  absl::MutexLock unmap_lock(&impl_->unmap_mu);
  std::vector<ucp_mem_h> unmap;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->alive = false;
    for (auto& [id, r] : impl_->regions) unmap.push_back(r.memh);
    impl_->regions.clear();
    impl_->grants.clear();
    impl_->grant_of.clear();
  }
  for (ucp_mem_h m : unmap) ucp_mem_unmap(impl_->context, m);
  ucp_worker_destroy(impl_->worker);
  ucp_cleanup(impl_->context);
}

std::string UcxPlane::transports() const { return impl_->transports; }
const std::string& UcxPlane::worker_address() const { return impl_->address; }

absl::StatusOr<UcxGrant> UcxPlane::Grant(const SegmentPtr& segment, uint64_t offset,
                                         uint64_t length) {
  if (segment == nullptr || segment->host_data() == nullptr || offset > segment->size() ||
      length > segment->size() - offset) {
    return absl::InvalidArgumentError("UCX grant: not host bytes of the segment");
  }
  Impl& m = *impl_;
  bool map = false;
  {
    absl::MutexLock lock(&m.mu);
    map = m.regions.find(segment->id()) == m.regions.end();
  }
  if (map) {
    // Registered once per segment; the release hook unmaps it before the
    // memory goes.
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = const_cast<uint8_t*>(segment->host_data());
    mp.length = segment->size();
    ucp_mem_h memh = nullptr;
    const ucs_status_t s = ucp_mem_map(m.context, &mp, &memh);
    if (s != UCS_OK) {
      return absl::UnavailableError(absl::StrCat("UCX registration of a segment of ",
                                                 segment->size(), " bytes: ", UcsError(s)));
    }
    bool added = false;
    {
      absl::MutexLock lock(&m.mu);
      if (m.alive && m.regions.find(segment->id()) == m.regions.end()) {
        m.regions[segment->id()] =
            Impl::Region{memh, segment->host_data(), segment->size(), segment};
        added = true;
      }
    }
    if (!added) {
      ucp_mem_unmap(m.context, memh);
    } else {
      segment->AddReleaseHook([weak = std::weak_ptr<Impl>(impl_), id = segment->id()] {
        if (std::shared_ptr<Impl> impl = weak.lock()) impl->Unregister(id);
      });
    }
  }
  absl::MutexLock lock(&m.mu);
  if (!m.alive) return absl::UnavailableError("the UCX data plane stopped");
  auto key = std::make_tuple(segment->id(), offset, length);
  auto it = m.grant_of.find(key);
  if (it != m.grant_of.end()) {
    const Impl::GrantEntry& g = m.grants[it->second];
    return UcxGrant{it->second, g.token, g.length};
  }
  Impl::GrantEntry g{segment->id(), offset, length, std::string(16, '\0')};
  for (size_t i = 0; i < 16; i += 8) {
    const uint64_t v = m.rng();
    std::memcpy(&g.token[i], &v, 8);
  }
  const uint64_t id = m.next_grant++;
  m.grants[id] = g;
  m.grant_of[key] = id;
  return UcxGrant{id, g.token, length};
}

void UcxPlane::Revoke(uint64_t segment_id) { impl_->Unregister(segment_id); }

absl::Status UcxPlane::Read(const std::string& peer, const std::string& worker,
                            const UcxGrant& grant, uint64_t offset, uint64_t length,
                            uint8_t* dest, absl::Duration timeout) {
  if (offset > grant.length || length > grant.length - offset) {
    return absl::InvalidArgumentError(absl::StrCat("UCX read of ", offset, "+", length,
                                                   " outside a grant of ", grant.length,
                                                   " bytes"));
  }
  auto p = std::make_shared<Impl::Pending>();
  p->peer = peer;
  p->dest = dest;
  p->length = length;
  Impl* impl = impl_.get();
  impl->Post([impl, p, worker, grant, offset] { impl->StartRead(p, worker, grant, offset); });
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&p->mu);
  while (!p->finished) {
    if (p->done.WaitWithDeadline(&p->mu, deadline)) {
      if (p->finished) break;
      // Past the deadline: UCX must be done with `dest` before we return.
      p->mu.Unlock();
      impl->Post([impl, p] { impl->Abandon(p); });
      p->mu.Lock();
      while (!p->finished) p->done.Wait(&p->mu);
      break;
    }
  }
  return p->status;
}

UcxPlane::Stats UcxPlane::stats() const {
  Stats out;
  absl::MutexLock lock(&impl_->mu);
  out.regions = impl_->regions.size();
  out.bytes_sent = impl_->bytes_sent;
  out.requests_refused = impl_->refused;
  out.bytes_by_peer = impl_->bytes_by_peer;
  out.transport_by_peer = impl_->transport_by_peer;
  return out;
}

}  // namespace weightd
