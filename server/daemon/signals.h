// The daemon's signals: SIGTERM and SIGINT are taken synchronously by the
// main thread (sigwait), never by a handler; SIGPIPE is ignored; and the
// teardown after a stop signal is bounded by an alarm.
//
// Process-wide state (signal masks and dispositions are the process's):
// InstallTermSignals once, on the main thread, before any thread of the
// daemon's own starts; the rest from any thread as each function says.
#ifndef WEIGHTD_SERVER_DAEMON_SIGNALS_H_
#define WEIGHTD_SERVER_DAEMON_SIGNALS_H_

#include "absl/time/time.h"

namespace weightd {

// Blocks SIGTERM and SIGINT in the calling (main) thread, so that every
// thread started from here on inherits the mask, and records it as the main
// thread. Threads started before main() that do not block them (OpenBLAS
// starts its workers when it is loaded) forward one they are handed to the
// main thread, where it stays pending for WaitForTermSignal or
// TermSignalPending. Ignores SIGPIPE.
void InstallTermSignals();

// True when SIGTERM or SIGINT is pending for the main thread (a restore
// asks between two entries). Main thread only.
bool TermSignalPending();

// Waits for SIGTERM or SIGINT and returns it. Main thread only.
int WaitForTermSignal();

// Sends SIGTERM to the main thread (a completed hand-over stops the daemon
// as a signal would). Any thread, after InstallTermSignals.
void StopMainThread();

// The teardown after a stop signal is bounded: gRPC at the process's thread
// limit (pids cgroup, TasksMax, RLIMIT_NPROC) can leave calls it never
// completes, and the daemon must still exit. Past `grace` and
// kTeardownSeconds more, SIGALRM logs shutdown_stuck, unlinks the path
// given to UnlinkIfTeardownStuck (if any) and ends the process with 0.
inline constexpr unsigned kTeardownSeconds = 2;
void ArmTeardownAlarm(absl::Duration grace);

// The socket file the stuck teardown unlinks (the data socket's, when no
// successor owns it). Copied; a path longer than a socket path can be is
// ignored.
void UnlinkIfTeardownStuck(const char* path);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_SIGNALS_H_
