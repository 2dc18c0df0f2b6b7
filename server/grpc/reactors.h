// Building blocks of the gRPC services (server/grpc/*_service.cc): stream
// writers fed by a producer thread, the Read stream, refusals, unary calls
// run on the worker pool and counted in flight, and per-kind stream caps.
// Reactors delete themselves in OnDone (the gRPC callback-API idiom).
#ifndef WEIGHTD_SERVER_GRPC_REACTORS_H_
#define WEIGHTD_SERVER_GRPC_REACTORS_H_

#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cancel.h"
#include "common/grpc/status_convert.h"
#include "server/base/thread_pool.h"
#include "server/grpc/call_drain.h"
#include "server/engine/weight_service.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

inline constexpr size_t kReadChunkBytes = 4u << 20;  // docs/DESIGN.md §4.3: chunks <= 4 MiB

// A server stream fed by a producer thread. Push() queues a message (the
// newest replaceable one supersedes a queued replaceable one, so a slow
// reader never makes progress reports pile up); Close() ends the stream once
// the queue drains. After Close() the producer must not touch the reactor.
template <typename T>
class QueuedWriter : public grpc::ServerWriteReactor<T> {
 public:
  QueuedWriter() = default;
  // Counts as a call in flight (CallDrain) until the stream is done.
  explicit QueuedWriter(CallDrain::Hold hold) : hold_(std::move(hold)) {}
  // `on_cancel` is cancelled when the client cancels the call or goes away
  // (the work behind the stream ends early). Set before the reactor is
  // returned to gRPC.
  QueuedWriter(CallDrain::Hold hold, std::shared_ptr<Cancellation> on_cancel)
      : hold_(std::move(hold)), on_cancel_(std::move(on_cancel)) {}

  void Push(T msg, bool replaceable) {
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return;
      if (replaceable && !queue_.empty() && queue_.back().second) {
        queue_.back().first = std::move(msg);
      } else {
        queue_.emplace_back(std::move(msg), replaceable);
      }
      if (writing_) return;
      writing_ = true;
      current_ = std::move(queue_.front().first);
      queue_.pop_front();
    }
    this->StartWrite(&current_);
  }

  bool cancelled() {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  void Close(grpc::Status status) {
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      final_ = status;
      if (writing_ || !queue_.empty()) return;  // OnWriteDone finishes
    }
    this->Finish(status);
  }

 private:
  void OnWriteDone(bool ok) override {
    bool start = false;
    bool finish = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        cancelled_ = true;
        queue_.clear();
      }
      if (!queue_.empty()) {
        writing_ = start = true;
        current_ = std::move(queue_.front().first);
        queue_.pop_front();
      } else if (closed_) {
        finish = true;
        status = cancelled_ ? grpc::Status::CANCELLED : final_;
      }
    }
    if (start) {
      this->StartWrite(&current_);
    } else if (finish) {
      this->Finish(status);
    }
  }
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (on_cancel_) on_cancel_->Cancel("the client cancelled the call");  // a leaf lock
  }
  void OnDone() override {
    // gRPC calls this after every other reaction and after Finish; taking
    // mu_ first orders the last Push, Close and OnCancel (each under mu_)
    // before the delete where TSan can see it (gRPC's own ordering is
    // inside libgrpc).
    { absl::MutexLock lock(&mu_); }
    delete this;  // gRPC reactor idiom
  }

  CallDrain::Hold hold_;
  const std::shared_ptr<Cancellation> on_cancel_;  // may be null
  absl::Mutex mu_;
  std::deque<std::pair<T, bool>> queue_ ABSL_GUARDED_BY(mu_);
  // The message in flight: written under mu_ while writing_ is false, then
  // read by gRPC until OnWriteDone; only one write is in flight at a time.
  T current_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_ ABSL_GUARDED_BY(mu_);
};

// Streams one ReadRange in <= 4 MiB chunks, producing each on demand.
class ReadReactor : public grpc::ServerWriteReactor<v1::ReadChunk> {
 public:
  ReadReactor(ReadRange range, CallDrain::Hold hold)
      : range_(std::move(range)), hold_(std::move(hold)) {
    Next();
  }

 private:
  void Next() {
    if (pos_ >= range_.length) {
      Finish(grpc::Status::OK);
      return;
    }
    size_t n = static_cast<size_t>(std::min<uint64_t>(kReadChunkBytes, range_.length - pos_));
    chunk_.set_offset(pos_);
    chunk_.set_data(reinterpret_cast<const char*>(range_.buffer->host_data() + range_.offset + pos_),
                    n);
    pos_ += n;
    StartWrite(&chunk_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }  // gRPC reactor idiom

  ReadRange range_;
  CallDrain::Hold hold_;
  uint64_t pos_ = 0;
  v1::ReadChunk chunk_;
};

// Finishes a unary call refused by access control.
inline grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* ctx,
                                        const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The same for a server stream.
template <typename T>
grpc::ServerWriteReactor<T>* RefuseStream(const absl::Status& status) {
  auto* writer = new QueuedWriter<T>();  // deletes itself in OnDone
  writer->Close(ToGrpcStatus(status));
  return writer;
}

// A unary call counted in flight (CallDrain) until gRPC is done with it.
class HeldUnaryReactor : public grpc::ServerUnaryReactor {
 public:
  explicit HeldUnaryReactor(CallDrain::Hold hold) : hold_(std::move(hold)) {}

 private:
  void OnDone() override { delete this; }  // gRPC reactor idiom
  CallDrain::Hold hold_;
};

// Runs `fn` on the worker pool (or, with a null pool, at once on gRPC's
// callback thread: for work of microseconds) and finishes the unary call
// with its status; UNAVAILABLE once the daemon drains.
// `change`: a call that changes what is served (CallDrain::Enter).
inline grpc::ServerUnaryReactor* RunOnPool(grpc::CallbackServerContext* ctx, ThreadPool* pool,
                                           CallDrain* drain, std::function<absl::Status()> fn,
                                           bool change = false) {
  auto hold = drain->Enter(change);
  if (!hold.ok()) return Refuse(ctx, hold.status());
  auto* reactor = new HeldUnaryReactor(std::move(*hold));  // deletes itself in OnDone
  if (pool == nullptr) {
    reactor->Finish(ToGrpcStatus(fn()));
  } else {
    pool->Schedule([reactor, fn = std::move(fn)] { reactor->Finish(ToGrpcStatus(fn())); });
  }
  return reactor;
}

// Counts the streams of one kind that hold a thread, up to a cap.
class StreamSlots {
 public:
  // One stream counted until it is destroyed. Move-only.
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept : slots_(std::exchange(other.slots_, nullptr)) {}
    Slot& operator=(Slot&&) = delete;
    ~Slot() {
      if (slots_ != nullptr) slots_->Release();
    }

   private:
    friend class StreamSlots;
    explicit Slot(StreamSlots* slots) : slots_(slots) {}
    StreamSlots* slots_ = nullptr;
  };

  // `what`: "Watch streams"; `flag`: the flag that sets `max`.
  StreamSlots(int max, std::string what, std::string flag)
      : max_(max), what_(std::move(what)), flag_(std::move(flag)) {}

  // A slot, or RESOURCE_EXHAUSTED naming the cap when all are taken.
  absl::StatusOr<Slot> Acquire() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (open_ >= max_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          open_, " ", what_, " are open, the daemon's limit (", flag_,
          "); try again once one ends"));
    }
    ++open_;
    return Slot(this);
  }

 private:
  void Release() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    --open_;
  }

  const int max_;
  const std::string what_;
  const std::string flag_;
  absl::Mutex mu_;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_REACTORS_H_
