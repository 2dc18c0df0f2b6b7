// Reads and writes of memory whose pages another process can take away.
//
// A memfd the daemon maps and also hands out writable (a publish's staging
// memfd) can lose pages under the daemon's mapping: the other holder
// punches a hole (fallocate PUNCH_HOLE, MADV_REMOVE) and, on hugetlb,
// takes the pool's free pages for itself; the daemon's next touch of that
// page finds none to fault in and the kernel sends SIGBUS. Such an access
// runs under RunFaultGuarded: a SIGBUS inside its range ends the access,
// not the process, and the caller fails that one request.
//
// How: one process-wide SIGBUS handler, installed on first use (keeping
// the disposition it replaces), siglongjmp()s to the innermost guarded
// access of the faulting thread whose range holds the fault address. Any
// other SIGBUS (an address outside every range the thread guards, another
// thread's fault, a signal sent with kill) is passed on: the previous
// disposition is restored and the signal happens again, so real bugs still
// crash and sanitizers still report them.
//
// Thread-safe: each thread guards its own accesses; guards nest.
#ifndef WEIGHTD_SERVER_BASE_FAULT_GUARD_H_
#define WEIGHTD_SERVER_BASE_FAULT_GUARD_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/functional/function_ref.h"

namespace weightd {

// What cut a guarded access short.
struct MemoryFault {
  uint64_t offset = 0;  // of the byte whose page could not be faulted in, from `begin`
};

// Runs `access`, which touches memory in [begin, begin + length) that
// another process may take pages from. Returns nullopt when it ran to its
// end, or where it faulted (SIGBUS inside the range); whatever it had
// written by then stays written.
//
// REQUIRES of `access`: it only reads and writes memory (memcpy, memcmp,
// a digest kernel). It may be abandoned at any instruction, so it takes no
// lock, allocates nothing, owns nothing with a destructor and calls
// nothing that does. Faults outside the range are not caught.
std::optional<MemoryFault> RunFaultGuarded(const void* begin, size_t length,
                                           absl::FunctionRef<void()> access);

// Installs the SIGBUS handler now (RunFaultGuarded does on first use): a
// program that installs SIGBUS handlers of its own (a crash reporter)
// calls this after them, so that they stay the fallback for faults no
// guard covers.
void InstallFaultGuard();

}  // namespace weightd

#endif  // WEIGHTD_SERVER_BASE_FAULT_GUARD_H_
