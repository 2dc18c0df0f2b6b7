// ThreadSanitizer builds only (WEIGHTD_SANITIZE=thread): teaches TSan the
// happens-before edges of absl::Mutex and absl::CondVar.
//
// Debian's Abseil (and gRPC, whose gpr_mu and grpc_core::Mutex are
// absl::Mutex) are not built with -fsanitize=thread, so TSan cannot see that
// their locks order anything and reports every access guarded by one as a
// race. This file interposes the exported lock entry points (the executable's
// definitions win over libabsl_synchronization.so's, also for gRPC's calls
// through the PLT), calls the real one (dlsym RTLD_NEXT) and tells TSan that
// the mutex was acquired (__tsan_acquire) or released (__tsan_release).
// Reader locks are modelled as exclusive ones, which can only hide races
// between two readers. The mangled names are those of Debian bookworm's
// Abseil (inline namespace debian3); a missing one aborts at first use.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace {

template <typename F>
F Real(const char* mangled) {
  void* p = ::dlsym(RTLD_NEXT, mangled);
  if (p == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found in the loaded Abseil\n", mangled);
    std::abort();
  }
  return reinterpret_cast<F>(p);
}

#define WD_ABSL(name) "_ZN4absl7debian3" name

void Acquired(const void* mu) { __tsan_acquire(const_cast<void*>(mu)); }
void Releasing(const void* mu) { __tsan_release(const_cast<void*>(mu)); }

// Abseil evaluates a Condition while holding the mutex internally, before the
// real call returns (possibly on the unlocking thread): the wrapped condition
// marks the acquisition first.
struct HeldCondition {
  const absl::Condition* cond;
  const absl::Mutex* mu;
  static bool Eval(HeldCondition* h) {
    Acquired(h->mu);
    bool r = h->cond->Eval();
    Releasing(h->mu);
    return r;
  }
};

// Abseil's deadlock detector keeps its graph under an internal spinlock TSan
// cannot see either; lock order is checked by clang's -Wthread-safety.
const bool kNoDeadlockGraph = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

using MuFn = void (*)(Mutex*);
using MuTryFn = bool (*)(Mutex*);
using MuCondFn = void (*)(Mutex*, const Condition&);
using MuCondDurFn = bool (*)(Mutex*, const Condition&, Duration);
using MuCondTimeFn = bool (*)(Mutex*, const Condition&, Time);

void Mutex::Lock() {
  static const auto real = Real<MuFn>(WD_ABSL("5Mutex4LockEv"));
  real(this);
  Acquired(this);
}
void Mutex::ReaderLock() {
  static const auto real = Real<MuFn>(WD_ABSL("5Mutex10ReaderLockEv"));
  real(this);
  Acquired(this);
}
bool Mutex::TryLock() {
  static const auto real = Real<MuTryFn>(WD_ABSL("5Mutex7TryLockEv"));
  bool locked = real(this);
  if (locked) Acquired(this);
  return locked;
}
bool Mutex::ReaderTryLock() {
  static const auto real = Real<MuTryFn>(WD_ABSL("5Mutex13ReaderTryLockEv"));
  bool locked = real(this);
  if (locked) Acquired(this);
  return locked;
}
void Mutex::Unlock() {
  static const auto real = Real<MuFn>(WD_ABSL("5Mutex6UnlockEv"));
  Releasing(this);
  real(this);
}
void Mutex::ReaderUnlock() {
  static const auto real = Real<MuFn>(WD_ABSL("5Mutex12ReaderUnlockEv"));
  Releasing(this);
  real(this);
}
void Mutex::LockWhen(const Condition& cond) {
  static const auto real = Real<MuCondFn>(WD_ABSL("5Mutex8LockWhenERKNS0_9ConditionE"));
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  real(this, wrapped);
  Acquired(this);
}
void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real = Real<MuCondFn>(WD_ABSL("5Mutex14ReaderLockWhenERKNS0_9ConditionE"));
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  real(this, wrapped);
  Acquired(this);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<MuCondDurFn>(
      WD_ABSL("5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  bool r = real(this, wrapped, timeout);
  Acquired(this);
  return r;
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<MuCondTimeFn>(
      WD_ABSL("5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  bool r = real(this, wrapped, deadline);
  Acquired(this);
  return r;
}
bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<MuCondDurFn>(
      WD_ABSL("5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  bool r = real(this, wrapped, timeout);
  Acquired(this);
  return r;
}
bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<MuCondTimeFn>(
      WD_ABSL("5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  bool r = real(this, wrapped, deadline);
  Acquired(this);
  return r;
}
void Mutex::Await(const Condition& cond) {
  static const auto real = Real<MuCondFn>(WD_ABSL("5Mutex5AwaitERKNS0_9ConditionE"));
  Releasing(this);
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  real(this, wrapped);
  Acquired(this);
}
bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<MuCondDurFn>(
      WD_ABSL("5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  Releasing(this);
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  bool r = real(this, wrapped, timeout);
  Acquired(this);
  return r;
}
bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<MuCondTimeFn>(
      WD_ABSL("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  Releasing(this);
  HeldCondition held{&cond, this};
  const Condition wrapped(&HeldCondition::Eval, &held);
  bool r = real(this, wrapped, deadline);
  Acquired(this);
  return r;
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>(WD_ABSL("7CondVar4WaitEPNS0_5MutexE"));
  Releasing(mu);
  real(this, mu);
  Acquired(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      WD_ABSL("7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE"));
  Releasing(mu);
  bool r = real(this, mu, timeout);
  Acquired(mu);
  return r;
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Time)>(
      WD_ABSL("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE"));
  Releasing(mu);
  bool r = real(this, mu, deadline);
  Acquired(mu);
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl
