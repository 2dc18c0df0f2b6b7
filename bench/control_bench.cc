// Control-plane benchmark: N concurrent clients, each with its own gRPC
// channel (its own connection) to the daemon's Unix socket, calling
//   --rpc fetch   Fetch (shm transport, the shard table of a loaded model)
//                 followed by Release of the lease it got, in a loop;
//   --rpc stats   Models.Stats in a loop: the cheapest unary call on the same
//                 server, the gRPC floor Fetch is compared against.
// Only the control plane is measured: no data-socket attach, no mapping.
//   --decode full   (default) every FetchResponse is parsed into a message,
//                   as a worker does with the one table it fetches;
//   --decode lease  only lease_id and token are read from the response bytes
//                   (the table's fields are skipped, tensors counted): the
//                   clients share the 2 cores with the daemon, and building
//                   201 sub-messages per call costs them more CPU than the
//                   daemon spends answering it.
//   --rate 0   (default) closed loop: each client calls again as soon as its
//              last call returns, so the clients saturate the 2 cores and
//              latency is set by Little's law (clients / throughput);
//   --rate R   open loop at R calls/s in total: client i calls at
//              start + i/R + k*clients/R (constant throughput, staggered), and
//              a call's latency counts from its scheduled time, so a daemon
//              that falls behind shows it as latency (no coordinated
//              omission). This is latency at a given load, the SLO reading.
//   --api sync      (default) a thread per client making blocking calls;
//   --api callback  gRPC's callback API: no thread per client, each client's
//                   next call is started from the last one's completion (or,
//                   open loop, by one scheduler thread when it is due). The
//                   load generator's CPU, which shares the 2 cores with the
//                   daemon, drops; the daemon's work per call is the same.
// After a warm-up, every call's latency is recorded; one JSON line is
// printed with throughput and p50/p99/max per RPC.
//
//   control_bench --socket PATH [--model NAME] [--rpc fetch|stats]
//                 [--clients N] [--seconds S] [--warmup-seconds S]
//                 [--world W] [--dtype keep|bf16|f16|f32] [--decode full|lease]
//                 [--rate R] [--api sync|callback]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/support/client_callback.h>

#include "absl/strings/numbers.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string socket;
  std::string model = "llama";
  std::string rpc = "fetch";
  int clients = 4;
  double seconds = 3.0;
  double warmup_seconds = 0.5;
  int64_t world = 8;
  std::string dtype = "keep";
  std::string decode = "full";
  double rate = 0.0;  // calls/s over all clients; 0 = closed loop
  std::string api = "sync";
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--socket") f->socket = v;
    else if (k == "--model") f->model = v;
    else if (k == "--rpc") f->rpc = v;
    else if (k == "--clients") ok = absl::SimpleAtoi(v, &f->clients);
    else if (k == "--seconds") ok = absl::SimpleAtod(v, &f->seconds);
    else if (k == "--warmup-seconds") ok = absl::SimpleAtod(v, &f->warmup_seconds);
    else if (k == "--world") ok = absl::SimpleAtoi(v, &f->world);
    else if (k == "--dtype") f->dtype = v;
    else if (k == "--decode") f->decode = v;
    else if (k == "--api") f->api = v;
    else if (k == "--rate") ok = absl::SimpleAtod(v, &f->rate) && f->rate >= 0.0;
    else {
      std::fprintf(stderr, "error: INVALID_ARGUMENT: unknown flag %s\n", k.c_str());
      return false;
    }
    if (!ok) {
      std::fprintf(stderr, "error: INVALID_ARGUMENT: bad value for %s: %s\n", k.c_str(),
                   v.c_str());
      return false;
    }
  }
  if (f->socket.empty() || f->clients < 1 || f->world < 1 ||
      (f->rpc != "fetch" && f->rpc != "stats") || (f->decode != "full" && f->decode != "lease") || (f->api != "sync" && f->api != "callback")) {
    std::fprintf(stderr, "error: INVALID_ARGUMENT: need --socket, --clients >= 1, --world >= 1, "
                         "--rpc fetch|stats, --decode full|lease, --api sync|callback\n");
    return false;
  }
  return true;
}

weightd::v1::DType ProtoDType(const std::string& d) {
  if (d == "bf16") return weightd::v1::BF16;
  if (d == "f16") return weightd::v1::F16;
  if (d == "f32") return weightd::v1::F32;
  return weightd::v1::DTYPE_UNSPECIFIED;
}

// Per-client results; each thread writes only its own.
struct ClientStats {
  std::vector<float> first_us;   // Fetch or Stats
  std::vector<float> second_us;  // Release
  uint64_t errors = 0;
  uint64_t tensors = 0;          // of the last Fetch
  std::string last_error;
};

std::shared_ptr<grpc::Channel> NewChannel(const std::string& socket) {
  grpc::ChannelArguments args;
  // A channel of its own per client: separate connections, as separate
  // worker processes would have.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(256 << 20);
  return grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args);
}

// lease_id (1), token (2) and the number of tensors (5) of a serialized
// FetchResponse, skipping everything else, in whatever order it comes.
bool DecodeLease(const grpc::ByteBuffer& buffer, uint64_t* lease_id, std::string* token,
                 uint64_t* tensors) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& sl : slices) {
    bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  *tensors = 0;
  while (uint32_t tag = in.ReadTag()) {
    int field = static_cast<int>(google::protobuf::internal::WireFormatLite::GetTagFieldNumber(tag));
    if (field == 1) {
      if (!in.ReadVarint64(lease_id)) return false;
    } else if (field == 2) {
      uint32_t n = 0;
      if (!in.ReadVarint32(&n) || !in.ReadString(token, static_cast<int>(n))) return false;
    } else {
      if (field == 5) ++*tensors;
      if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) return false;
    }
  }
  return in.ConsumedEntireMessage();
}

float Micros(Clock::duration d) {
  return std::chrono::duration<float, std::micro>(d).count();
}

// The Fetch every client sends: its rank's shard table over shm.
weightd::v1::FetchRequest ClientRequest(const Flags& f, int index) {
  weightd::v1::FetchRequest req;
  req.set_model(f.model);
  req.add_mesh_shape(f.world);
  req.add_coord(index % f.world);
  req.set_dtype(ProtoDType(f.dtype));
  req.set_transport(weightd::v1::SHM);
  return req;
}

// Open loop (--rate > 0): client `index` makes its k-th call at
// first_due + k * period, the clients staggered by 1/rate.
struct OpenLoopSchedule {
  Clock::duration period{};
  Clock::time_point first_due;
};

OpenLoopSchedule ScheduleFor(const Flags& f, int index) {
  OpenLoopSchedule s;
  if (f.rate <= 0.0) return s;
  s.period = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(f.clients / f.rate));
  s.first_due = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(index / f.rate));
  return s;
}

void RunClient(const Flags& f, int index, std::atomic<int>* phase, ClientStats* out) {
  auto channel = NewChannel(f.socket);
  auto shards = weightd::v1::Shards::NewStub(channel);
  auto models = weightd::v1::Models::NewStub(channel);
  const grpc::internal::RpcMethod fetch_method("/weightd.v1.Shards/Fetch",
                                               grpc::internal::RpcMethod::NORMAL_RPC, channel);
  const weightd::v1::FetchRequest req = ClientRequest(f, index);
  out->first_us.reserve(1 << 16);
  out->second_us.reserve(1 << 16);
  const bool open_loop = f.rate > 0.0;
  const OpenLoopSchedule schedule = ScheduleFor(f, index);
  int64_t k = 0;
  // phase: 0 warm-up, 1 measure, 2 stop.
  for (;;) {
    // The time the call counts from: when it was due (open loop), or now.
    Clock::time_point due = Clock::now();
    if (open_loop) {
      due = schedule.first_due + k++ * schedule.period;
      std::this_thread::sleep_until(due);
    }
    int p = phase->load(std::memory_order_acquire);
    if (p == 2) break;
    bool record = p == 1;
    if (f.rpc == "stats") {
      grpc::ClientContext ctx;
      weightd::v1::StatsRequest sreq;
      weightd::v1::StatsResponse sresp;
      Clock::time_point t0 = open_loop ? due : Clock::now();
      grpc::Status s = models->Stats(&ctx, sreq, &sresp);
      Clock::time_point t1 = Clock::now();
      if (!s.ok()) {
        ++out->errors;
        out->last_error = s.error_message();
        continue;
      }
      if (record) out->first_us.push_back(Micros(t1 - t0));
      continue;
    }
    grpc::ClientContext fctx;
    weightd::v1::ReleaseRequest rreq;
    Clock::time_point t0 = open_loop ? due : Clock::now();
    grpc::Status s;
    if (f.decode == "full") {
      weightd::v1::FetchResponse resp;
      s = shards->Fetch(&fctx, req, &resp);
      out->tensors = static_cast<uint64_t>(resp.tensors_size());
      rreq.set_lease_id(resp.lease_id());
      rreq.set_token(resp.token());
    } else {
      grpc::ByteBuffer raw;
      s = grpc::internal::BlockingUnaryCall(channel.get(), fetch_method, &fctx, req, &raw);
      uint64_t id = 0;
      if (s.ok() && !DecodeLease(raw, &id, rreq.mutable_token(), &out->tensors)) {
        s = grpc::Status(grpc::StatusCode::INTERNAL, "undecodable FetchResponse");
      }
      rreq.set_lease_id(id);
    }
    Clock::time_point t1 = Clock::now();
    if (!s.ok()) {
      ++out->errors;
      out->last_error = s.error_message();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    grpc::ClientContext rctx;
    weightd::v1::ReleaseResponse rresp;
    grpc::Status r = shards->Release(&rctx, rreq, &rresp);
    Clock::time_point t2 = Clock::now();
    if (!r.ok()) {
      ++out->errors;
      out->last_error = r.error_message();
      continue;
    }
    if (record) {
      out->first_us.push_back(Micros(t1 - t0));
      out->second_us.push_back(Micros(t2 - t1));
    }
  }
}

// Open loop, callback API: one thread starts every client's call when it is
// due; calls whose completion comes after their next due time start at once.
class Scheduler {
 public:
  using Task = std::pair<Clock::time_point, std::function<void()>>;

  Scheduler() : thread_([this] { Loop(); }) {}
  ~Scheduler() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  void At(Clock::time_point when, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push(Task{when, std::move(fn)});
    }
    cv_.notify_one();
  }

 private:
  struct Later {
    bool operator()(const Task& a, const Task& b) const { return a.first > b.first; }
  };

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (queue_.empty()) {
        cv_.wait(lock);
        continue;
      }
      Clock::time_point when = queue_.top().first;
      if (Clock::now() < when) {
        cv_.wait_until(lock, when);
        continue;
      }
      std::function<void()> fn = queue_.top().second;
      queue_.pop();
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Task, std::vector<Task>, Later> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is built
};

// One client of --api callback. Exactly one call of this client is in flight
// at a time, and each is started from the previous one's completion (or by
// the scheduler), so its fields need no lock.
class CallbackClient {
 public:
  CallbackClient(const Flags& f, int index, std::atomic<int>* phase, ClientStats* out,
                 Scheduler* scheduler, std::atomic<int>* running)
      : f_(f), phase_(phase), out_(out), scheduler_(scheduler), running_(running),
        channel_(NewChannel(f.socket)),
        shards_(weightd::v1::Shards::NewStub(channel_)),
        models_(weightd::v1::Models::NewStub(channel_)),
        fetch_method_("/weightd.v1.Shards/Fetch", grpc::internal::RpcMethod::NORMAL_RPC,
                      channel_),
        req_(ClientRequest(f, index)) {
    out_->first_us.reserve(1 << 16);
    out_->second_us.reserve(1 << 16);
    const OpenLoopSchedule schedule = ScheduleFor(f, index);
    period_ = schedule.period;
    next_due_ = schedule.first_due;
  }

  void Start() {
    running_->fetch_add(1);
    Next();
  }

 private:
  // Starts the next call: now (closed loop, or late), or when it is due.
  void Next() {
    if (f_.rate <= 0.0) {
      Begin(Clock::now());
      return;
    }
    Clock::time_point due = next_due_;
    next_due_ += period_;
    if (Clock::now() >= due) {
      Begin(due);
    } else {
      scheduler_->At(due, [this, due] { Begin(due); });
    }
  }

  void Begin(Clock::time_point due) {
    int p = phase_->load(std::memory_order_acquire);
    if (p == 2) {
      running_->fetch_sub(1);
      return;
    }
    record_ = p == 1;
    due_ = due;
    ctx_ = NewContext();
    if (f_.rpc == "stats") {
      models_->async()->Stats(ctx_.get(), &sreq_, &sresp_, [this](grpc::Status s) {
        if (Failed(s)) {
          scheduler_->At(Clock::now() + std::chrono::milliseconds(10), [this] { Next(); });
          return;
        }
        if (record_) out_->first_us.push_back(Micros(Clock::now() - due_));
        Next();
      });
      return;
    }
    if (f_.decode == "full") {
      shards_->async()->Fetch(ctx_.get(), &req_, &resp_, [this](grpc::Status s) {
        out_->tensors = static_cast<uint64_t>(resp_.tensors_size());
        rreq_.set_lease_id(resp_.lease_id());
        rreq_.set_token(resp_.token());
        OnFetch(std::move(s));
      });
    } else {
      grpc::internal::CallbackUnaryCall<weightd::v1::FetchRequest, grpc::ByteBuffer>(
          channel_.get(), fetch_method_, ctx_.get(), &req_, &raw_, [this](grpc::Status s) {
            uint64_t id = 0;
            if (s.ok() && !DecodeLease(raw_, &id, rreq_.mutable_token(), &out_->tensors)) {
              s = grpc::Status(grpc::StatusCode::INTERNAL, "undecodable FetchResponse");
            }
            rreq_.set_lease_id(id);
            OnFetch(std::move(s));
          });
    }
  }

  void OnFetch(grpc::Status s) {
    fetched_ = Clock::now();
    if (Failed(s)) {
      scheduler_->At(fetched_ + std::chrono::milliseconds(10), [this] { Next(); });
      return;
    }
    ctx_ = NewContext();
    shards_->async()->Release(ctx_.get(), &rreq_, &rresp_, [this](grpc::Status r) {
      Clock::time_point t2 = Clock::now();
      if (!Failed(r) && record_) {
        out_->first_us.push_back(Micros(fetched_ - due_));
        out_->second_us.push_back(Micros(t2 - fetched_));
      }
      Next();
    });
  }

  // A deadline on every call: one that never completes would otherwise
  // keep main() waiting for this client forever.
  static std::unique_ptr<grpc::ClientContext> NewContext() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return ctx;
  }

  bool Failed(const grpc::Status& s) {
    if (s.ok()) return false;
    ++out_->errors;
    out_->last_error = s.error_message();
    return true;
  }

  const Flags& f_;
  std::atomic<int>* phase_;
  ClientStats* out_;
  Scheduler* scheduler_;
  std::atomic<int>* running_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<weightd::v1::Shards::Stub> shards_;
  std::unique_ptr<weightd::v1::Models::Stub> models_;
  const grpc::internal::RpcMethod fetch_method_;
  Clock::duration period_{};
  Clock::time_point next_due_;
  // The call in flight.
  std::unique_ptr<grpc::ClientContext> ctx_;
  bool record_ = false;
  Clock::time_point due_, fetched_;
  weightd::v1::FetchRequest req_;
  weightd::v1::FetchResponse resp_;
  grpc::ByteBuffer raw_;
  weightd::v1::ReleaseRequest rreq_;
  weightd::v1::ReleaseResponse rresp_;
  weightd::v1::StatsRequest sreq_;
  weightd::v1::StatsResponse sresp_;
};

double Percentile(std::vector<float>& v, double q) {
  if (v.empty()) return 0.0;
  size_t k = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  if (!ParseFlags(argc, argv, &f)) return 2;
  std::atomic<int> phase{0};
  std::vector<ClientStats> stats(static_cast<size_t>(f.clients));
  std::vector<std::thread> threads;
  std::atomic<int> running{0};
  std::unique_ptr<Scheduler> scheduler;
  std::vector<std::unique_ptr<CallbackClient>> callback_clients;
  if (f.api == "sync") {
    for (int i = 0; i < f.clients; ++i) {
      threads.emplace_back(RunClient, std::cref(f), i, &phase, &stats[static_cast<size_t>(i)]);
    }
  } else {
    scheduler = std::make_unique<Scheduler>();
    for (int i = 0; i < f.clients; ++i) {
      callback_clients.push_back(std::make_unique<CallbackClient>(
          f, i, &phase, &stats[static_cast<size_t>(i)], scheduler.get(), &running));
    }
    for (auto& c : callback_clients) c->Start();
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(f.warmup_seconds));
  Clock::time_point start = Clock::now();
  phase.store(1, std::memory_order_release);
  std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
  phase.store(2, std::memory_order_release);
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  for (auto& t : threads) t.join();
  // Callback clients stop at their next call; wait until none is in flight
  // before their channels and the scheduler go.
  while (running.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  scheduler.reset();
  callback_clients.clear();

  std::vector<float> first, second;
  uint64_t errors = 0, tensors = 0;
  std::string last_error;
  for (ClientStats& s : stats) {
    first.insert(first.end(), s.first_us.begin(), s.first_us.end());
    second.insert(second.end(), s.second_us.begin(), s.second_us.end());
    errors += s.errors;
    tensors = std::max(tensors, s.tensors);
    if (!s.last_error.empty()) last_error = s.last_error;
  }
  const double n = static_cast<double>(first.size());
  const double max_first = first.empty() ? 0.0 : *std::max_element(first.begin(), first.end());
  const double p50 = Percentile(first, 0.50), p99 = Percentile(first, 0.99);
  const double rp50 = Percentile(second, 0.50), rp99 = Percentile(second, 0.99);
  std::printf(
      "{\"rpc\": \"%s\", \"api\": \"%s\", \"decode\": \"%s\", \"clients\": %d, \"rate\": %.1f, "
      "\"seconds\": %.3f, \"calls\": %.0f, \"calls_per_s\": %.1f, \"p50_ms\": %.4f, \"p99_ms\": %.4f, \"max_ms\": %.4f, "
      "\"release_p50_ms\": %.4f, \"release_p99_ms\": %.4f, \"tensors\": %llu, "
      "\"errors\": %llu",
      f.rpc.c_str(), f.api.c_str(), f.decode.c_str(), f.clients, f.rate, elapsed, n, n / elapsed, p50 / 1e3, p99 / 1e3, max_first / 1e3,
      rp50 / 1e3, rp99 / 1e3, static_cast<unsigned long long>(tensors),
      static_cast<unsigned long long>(errors));
  if (!last_error.empty()) {
    std::string e;
    for (char c : last_error) {
      if (c == '"' || c == '\\') e += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) e += c;
    }
    std::printf(", \"last_error\": \"%s\"", e.c_str());
  }
  std::printf("}\n");
  return n > 0 ? 0 : 1;
}
