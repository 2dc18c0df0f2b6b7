// Access control: who a caller is (Principal), who may read a model or an
// adapter (ReaderList), and the daemon-wide rules (AccessPolicy): which Unix
// peers may use the sockets at all, who may change what is served, who may
// read what, and who may use a lease. No gRPC here; server/grpc turns a call
// into a Principal and the data socket turns SO_PEERCRED into one.
//
// The daemon's own uid is always allowed everywhere (sockets, admin, every
// model and lease): it can read the daemon's memory anyway.
//
// Thread-safe: everything here is immutable after construction.
#ifndef WEIGHTD_SERVER_AUTH_ACCESS_CONTROL_H_
#define WEIGHTD_SERVER_AUTH_ACCESS_CONTROL_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/auth/peer_identity.h"

namespace weightd {

// Who made a call.
struct Principal {
  enum class Via {
    kInternal,    // the daemon itself (preloads, tests): never checked
    kUnixSocket,  // a peer on the gRPC Unix socket or the data socket
    kTcp,         // a client on --listen
  };
  Via via = Via::kInternal;
  PeerIdentity peer;       // kUnixSocket only
  std::string token_name;  // kTcp: the bearer token's name; empty = no token
  std::string cert_cn;     // kTcp: verified client-certificate CN; empty = none

  static Principal Internal() { return Principal{}; }
  static Principal UnixPeer(PeerIdentity peer);
  static Principal Tcp(std::string token_name, std::string cert_cn);

  // "uid 1000 (gid 1000)", "token \"alice\"", "anonymous TCP client"...
  std::string Describe() const;
  // Same caller: same uid on a Unix socket; same token name and certificate
  // CN on TCP. Callers that came different ways are never the same.
  bool SameAs(const Principal& other) const;
};

// Who may read one model or adapter: "uid:N", "gid:N" (primary or
// supplementary group), "token:NAME" (bearer-token principal), "cn:NAME"
// (client-certificate common name). Empty = everyone.
class ReaderList {
 public:
  ReaderList() = default;
  // Each spec may itself be a comma-separated list; blanks are skipped.
  // INVALID_ARGUMENT names a malformed entry.
  static absl::StatusOr<ReaderList> Parse(absl::Span<const std::string> specs);

  bool empty() const { return rules_.empty(); }
  bool Admits(const Principal& p) const;
  // Only token:NAME and cn:NAME entries (identities of TCP callers).
  bool OnlyTcpIdentities() const;
  bool HasToken() const;
  bool HasCertCn() const;
  // Canonical entries, in the order given, duplicates dropped.
  std::vector<std::string> ToStrings() const;

 private:
  struct Rule {
    enum class Kind { kUid, kGid, kToken, kCertCn } kind;
    uint32_t id = 0;   // kUid, kGid
    std::string name;  // kToken, kCertCn
  };
  std::vector<Rule> rules_;
};

// One object a read must be allowed by: a model, or an adapter merged into
// the generation being read.
struct ReadGuard {
  std::string what;  // "model \"m\"", "adapter \"a\""
  ReaderList readers;
};

// A canonical name for what `guards` admit together: two guard lists with
// the same scope admit exactly the same principals (a conjunction of reader
// lists, each a disjunction of rules; public lists drop out, entries and
// lists are sorted and deduplicated). "" = public. Bytes computed for one
// scope may be shared with any request of the same scope and no other: the
// materialization cache is partitioned by it, so a segment a client maps or
// Reads never holds bytes of something it may not read (issue #16 F1).
std::string ReadScope(absl::Span<const ReadGuard> guards);

// Who fetched a lease and what it exposes; the lease keeps it (LeaseContents::owner).
struct LeaseOwner {
  Principal owner;
  std::vector<ReadGuard> guards;  // of the generation the lease holds
};

struct AccessPolicyOptions {
  // Unix peers allowed on both sockets; both empty = anyone who can open
  // the socket files (their mode and directory decide).
  std::vector<uid_t> allow_uids;
  std::vector<gid_t> allow_gids;
  // Who may Load/Unload models and adapters and Apply; all three empty =
  // everyone who got through authentication and the allow-list.
  std::vector<uid_t> admin_uids;
  std::vector<gid_t> admin_gids;
  std::vector<std::string> admin_token_names;
  // --fleet-members: the daemons that may load from this one
  // (FindCheckpoint, ReadCheckpoint), as the TCP identities they present:
  // "token:NAME" (their --peer-token-file's name in --auth-token-file),
  // "cn:NAME" (their client certificate's CN). Empty: nobody.
  ReaderList fleet_members;
  uid_t daemon_uid = 0;  // always allowed; main() sets getuid()
};

class AccessPolicy {
 public:
  explicit AccessPolicy(AccessPolicyOptions options) : options_(std::move(options)) {}

  // May this Unix peer use the sockets at all? PERMISSION_DENIED names it.
  // Principals that are not Unix peers pass.
  absl::Status AdmitPeer(const Principal& p) const;
  // May `p` change what is served (`action` names it in the error)?
  absl::Status CheckAdmin(const Principal& p, absl::string_view action) const;
  // May `p` call the peer RPCs (FindCheckpoint, ReadCheckpoint)? Only a TCP
  // caller that --fleet-members lists: not a local admin, not the daemon's
  // own uid. PERMISSION_DENIED says which flag enables them. What a member
  // may then read is CheckRead's (a holder offers a copy only if a model or
  // adapter holding it admits the member).
  absl::Status CheckFleetMember(const Principal& p) const;
  // May `p` read something guarded by every one of `guards`?
  // PERMISSION_DENIED names the first guard that refuses.
  absl::Status CheckRead(const Principal& p, absl::Span<const ReadGuard> guards) const;
  // May `caller` use (attach, read, release) lease `lease_id`, which `owner`
  // fetched? Yes for its owner; for a different caller of the same kind
  // (another uid) only if the lease's generation is private and the caller
  // is one of its readers; a caller of another kind (fetched over TCP,
  // attached on the data socket) must be able to read the generation.
  absl::Status CheckLeaseUse(const Principal& caller, uint64_t lease_id,
                             const LeaseOwner& owner) const;

  const AccessPolicyOptions& options() const { return options_; }

 private:
  bool IsDaemonUid(const Principal& p) const;

  const AccessPolicyOptions options_;
};

// Parses "1000,1001" into numbers (blanks skipped); `flag` names the flag in
// the INVALID_ARGUMENT.
absl::StatusOr<std::vector<uint32_t>> ParseIdList(absl::string_view flag, absl::string_view text);

// Bearer tokens for the TCP listener, read from a file: one token per line,
// or "NAME TOKEN" to give it a principal name (a bare token on line N is
// named "token-N"); '#' starts a comment line. Tokens are at least 16
// characters without whitespace; names are letters, digits and . _ @ -.
class BearerTokens {
 public:
  static absl::StatusOr<BearerTokens> Parse(absl::string_view text, absl::string_view origin);
  static absl::StatusOr<BearerTokens> Load(const std::string& path);

  // `authorization` is the metadata value ("Bearer <token>"). Returns the
  // token's name; UNAUTHENTICATED when missing, malformed or unknown. Every
  // known token is compared in full, in time independent of where (or
  // whether) it matches.
  absl::StatusOr<std::string> Authenticate(std::optional<absl::string_view> authorization) const;

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    std::string token;
  };
  std::vector<Entry> entries_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_AUTH_ACCESS_CONTROL_H_
