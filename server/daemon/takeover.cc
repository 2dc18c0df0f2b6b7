#include "server/daemon/takeover.h"

#include <sys/stat.h>

#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"
#include "server/daemon/startup.h"

namespace weightd {
namespace {

// The state comes from the predecessor's journal: the same directory.
absl::Status CheckSameStateDir(const HandoverReceived& got, const StateDir& state_dir,
                               const std::string& flag) {
  struct stat theirs, mine;
  if (::stat(got.state_dir.c_str(), &theirs) != 0 || ::fstat(state_dir.fd(), &mine) != 0 ||
      theirs.st_dev != mine.st_dev || theirs.st_ino != mine.st_ino) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--take-over: the running daemon journals in --state-dir ", got.state_dir,
        ", this one in ", flag, "; give both the same directory"));
  }
  return absl::OkStatus();
}

}  // namespace

TakeOver::TakeOver(std::unique_ptr<HandoverClient> client, AdoptVerify verify)
    : client_(std::move(client)), donated_(std::make_unique<DonatedCheckpoints>(verify)) {}

absl::StatusOr<std::unique_ptr<TakeOver>> TakeOver::Begin(const HandoverSocket& at,
                                                          const StateDir& state_dir,
                                                          const DaemonFlags& flags) {
  auto begun = HandoverClient::Begin(at, absl::Seconds(150));
  if (absl::IsNotFound(begun.status())) {
    LogEvent(LogLevel::kInfo, "take_over_none",
             {{"handover_socket", flags.handover_socket},
              {"reason", std::string(begun.status().message())},
              {"action", "starting as usual"}});
    return nullptr;
  }
  if (!begun.ok()) return begun.status();
  HandoverReceived& got = (*begun)->received();
  WD_RETURN_IF_ERROR(CheckSameStateDir(got, state_dir, flags.state_dir));
  LogEvent(LogLevel::kInfo, "take_over_begin",
           {{"predecessor_pid", absl::StrCat(got.pid)},
            {"checkpoints", absl::StrCat(got.checkpoints.size())},
            {"segment_bytes", absl::StrCat(got.segment_bytes)},
            {"verify", AdoptVerifyName(flags.take_over_verify)}});
  std::unique_ptr<TakeOver> taking(new TakeOver(std::move(*begun), flags.take_over_verify));
  for (DonatedCheckpoint& c : got.checkpoints) taking->donated_->Add(std::move(c));
  taking->handover_listen_fd_ = std::move(got.handover_listen_fd);
  if (got.host != HostName()) taking->from_host_ = got.host;
  WD_RETURN_IF_ERROR(taking->CheckSockets(flags));
  return taking;
}

absl::Status TakeOver::CheckSockets(const DaemonFlags& flags) const {
  const HandoverReceived& got = client_->received();
  // The sockets handed over must be the ones this daemon was told to
  // serve (a different --socket would advertise paths nobody serves).
  for (const auto& [fd, want, what] :
       {std::tuple<int, std::string, const char*>{got.grpc_listen_fd.get(),
                                                  flags.grpc.unix_socket, "--socket"},
        {got.data_listen_fd.get(), flags.data.path, "--data-socket"}}) {
    auto bound = BoundUnixPath(fd);
    struct stat a, b;
    if (!bound.ok() || ::stat(bound->c_str(), &a) != 0 || ::stat(want.c_str(), &b) != 0 ||
        a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--take-over: the running daemon's ", what, " is ",
          bound.ok() ? *bound : bound.status().ToString(), ", this one's ", want));
    }
  }
  return absl::OkStatus();
}

void TakeOver::LendTo(DaemonFlags* flags) {
  HandoverReceived& got = client_->received();
  flags->service.donated = donated_.get();
  flags->grpc.adopt_unix_listen_fd = got.grpc_listen_fd.release();
  flags->data.adopt_listen_fd = got.data_listen_fd.release();
}

UniqueFd TakeOver::TakeHandoverListenFd() { return std::move(handover_listen_fd_); }

RestoreReport TakeOver::Restore(WeightService& service, const RestorePlan& plan,
                                StateJournal* journal, const std::function<bool()>& stop,
                                uint64_t floor_margin) {
  const absl::Time start = absl::Now();
  RestoreReport restored = RestoreState(service, plan, journal, stop, floor_margin);
  if (restored.interrupted) return restored;
  LogEvent(LogLevel::kInfo, "take_over_restored",
           {{"seconds", absl::StrCat(absl::ToDoubleSeconds(absl::Now() - start))},
            {"adopted", absl::StrCat(donated_->adopted())},
            {"read_instead", absl::StrCat(donated_->refused())}});
  return restored;
}

absl::Status TakeOver::Confirm(const WeightService& service, const RestoreReport& restored) {
  if (size_t unused = donated_->DropUnused(); unused > 0) {
    LogEvent(LogLevel::kInfo, "take_over_unused",
             {{"checkpoints", absl::StrCat(unused)},
              {"reason", "no restored model serves their files"}});
  }
  WD_RETURN_IF_ERROR(CheckRestoredAll(restored));
  return CheckServesAsPredecessor(ServedModels(service), client_->received().models);
}

absl::Status TakeOver::Ready(WeightService& service) {
  WD_ASSIGN_OR_RETURN(uint64_t next_lease, client_->Ready(absl::Seconds(30)));
  service.leases()->InheritIdsBelow(next_lease + kLeaseIdMargin);
  return absl::OkStatus();
}

absl::Status TakeOver::Started() {
  if (absl::Status s = client_->Started(absl::Seconds(30)); !s.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "--take-over: the running daemon did not confirm the hand-over (", s.ToString(),
        "); it serves on"));
  }
  client_.reset();
  return absl::OkStatus();
}

}  // namespace weightd
