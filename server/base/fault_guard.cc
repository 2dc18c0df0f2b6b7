#include "server/base/fault_guard.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <ucontext.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace weightd {
namespace {

// One guarded access in progress, on the stack of the thread running it.
struct GuardFrame {
  sigjmp_buf jump;
  uintptr_t begin = 0;
  uintptr_t end = 0;
  GuardFrame* outer = nullptr;  // the access this one runs inside, if any
  // Set by the handler before it jumps: the fault address and the signal
  // mask the access ran with (restored after the jump).
  volatile uintptr_t fault = 0;
  volatile bool has_mask = false;
  sigset_t mask;
};

// The thread's innermost guarded access. initial-exec: reading it from the
// signal handler must not call into the dynamic linker (which may allocate).
__attribute__((tls_model("initial-exec"))) thread_local GuardFrame* t_innermost = nullptr;

std::once_flag g_installed;
struct sigaction g_previous;  // written once, before the handler can run

// Not a fault any guard of this thread covers: the disposition before ours
// takes it. A fault happens again when the handler returns (the faulting
// instruction runs again); a signal sent by a process is raised again (it
// stays pending until this handler returns).
void PassOn(int sig, const siginfo_t* info) {
  sigaction(SIGBUS, &g_previous, nullptr);
  if (info == nullptr || info->si_code <= 0) raise(sig);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  // si_code > 0: sent by the kernel for an access (SI_USER, SI_TKILL and
  // SI_QUEUE are <= 0).
  if (info != nullptr && info->si_code > 0) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
    for (GuardFrame* f = t_innermost; f != nullptr; f = f->outer) {
      if (addr >= f->begin && addr < f->end) {
        f->fault = addr;
        if (context != nullptr) {
          // The kernel writes its sigset (64 signals, 8 bytes) where
          // uc_sigmask starts; glibc's sigset_t is larger.
          sigemptyset(&f->mask);
          std::memcpy(&f->mask, &static_cast<const ucontext_t*>(context)->uc_sigmask,
                      sizeof(uint64_t));
          f->has_mask = true;
        }
        siglongjmp(f->jump, 1);
      }
    }
  }
  PassOn(sig, info);
}

}  // namespace

void InstallFaultGuard() {
  std::call_once(g_installed, [] {
    struct sigaction action = {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &g_previous) != 0) std::abort();
  });
}

std::optional<MemoryFault> RunFaultGuarded(const void* begin, size_t length,
                                           absl::FunctionRef<void()> access) {
  InstallFaultGuard();
  GuardFrame frame;
  frame.begin = reinterpret_cast<uintptr_t>(begin);
  frame.end = frame.begin + length;
  frame.outer = t_innermost;
  // No mask saved (0): that would cost a system call per access. The
  // handler runs with SIGBUS (and, under some interposers, every signal)
  // blocked; the mask the access ran with is put back after the jump, from
  // the signal's context: a system call on the fault's path only.
  if (sigsetjmp(frame.jump, 0) != 0) {
    t_innermost = frame.outer;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (frame.has_mask) pthread_sigmask(SIG_SETMASK, &frame.mask, nullptr);
    return MemoryFault{static_cast<uint64_t>(frame.fault - frame.begin)};
  }
  t_innermost = &frame;
  std::atomic_signal_fence(std::memory_order_seq_cst);  // set before any access
  access();
  std::atomic_signal_fence(std::memory_order_seq_cst);  // every access done first
  t_innermost = frame.outer;
  return std::nullopt;
}

}  // namespace weightd
