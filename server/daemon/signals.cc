#include "server/daemon/signals.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace weightd {
namespace {

// Set once by InstallTermSignals, before any thread of ours exists.
pthread_t g_main_thread;

// Unlinked if the teardown is stuck. A buffer of our own (not a pointer
// into an object): the alarm may fire while the daemon is destroyed. A
// socket path fits in sockaddr_un's 108 bytes.
char g_unlink_path[128];
std::atomic<bool> g_unlink_set{false};

void ForwardToMainThread(int sig) { ::pthread_kill(g_main_thread, sig); }

void OnTeardownStuck(int) {
  if (g_unlink_set.load()) ::unlink(g_unlink_path);
  static const char kLine[] =
      "warning shutdown_stuck: teardown outlived --shutdown-grace-seconds + 2 s; exiting\n";
  (void)!::write(STDERR_FILENO, kLine, sizeof(kLine) - 1);
  ::_exit(0);
}

sigset_t TermSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

}  // namespace

void InstallTermSignals() {
  const sigset_t signals = TermSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  g_main_thread = ::pthread_self();
  struct sigaction forward = {};
  forward.sa_handler = ForwardToMainThread;
  sigemptyset(&forward.sa_mask);
  sigaction(SIGTERM, &forward, nullptr);
  sigaction(SIGINT, &forward, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

bool TermSignalPending() {
  sigset_t pending;
  if (sigpending(&pending) != 0) return false;
  for (int s : {SIGTERM, SIGINT}) {
    if (sigismember(&pending, s)) return true;
  }
  return false;
}

int WaitForTermSignal() {
  const sigset_t signals = TermSignals();
  int sig = 0;
  sigwait(&signals, &sig);
  return sig;
}

void StopMainThread() { ::pthread_kill(g_main_thread, SIGTERM); }

void ArmTeardownAlarm(absl::Duration grace) {
  signal(SIGALRM, OnTeardownStuck);
  alarm(static_cast<unsigned>(absl::ToInt64Seconds(grace)) + kTeardownSeconds);
}

void UnlinkIfTeardownStuck(const char* path) {
  if (std::strlen(path) >= sizeof(g_unlink_path)) return;
  std::strcpy(g_unlink_path, path);
  g_unlink_set.store(true);
}

}  // namespace weightd
