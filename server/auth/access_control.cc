#include "server/auth/access_control.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/fd.h"

namespace weightd {
namespace {

constexpr size_t kMinTokenLength = 16;
constexpr uint64_t kMaxTokenFileBytes = 1 << 20;

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 128) return false;
  for (unsigned char c : name) {
    if (!(absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '@' || c == '-')) return false;
  }
  return true;
}

// Compares without an early exit; time depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

Principal Principal::UnixPeer(PeerIdentity peer) {
  Principal p;
  p.via = Via::kUnixSocket;
  p.peer = std::move(peer);
  return p;
}

Principal Principal::Tcp(std::string token_name, std::string cert_cn) {
  Principal p;
  p.via = Via::kTcp;
  p.token_name = std::move(token_name);
  p.cert_cn = std::move(cert_cn);
  return p;
}

std::string Principal::Describe() const {
  switch (via) {
    case Via::kInternal:
      return "the daemon";
    case Via::kUnixSocket:
      return absl::StrCat("uid ", peer.uid, " (gid ", peer.gid, ")");
    case Via::kTcp:
      if (!token_name.empty() && !cert_cn.empty()) {
        return absl::StrCat("token \"", token_name, "\" (certificate CN \"", cert_cn, "\")");
      }
      if (!token_name.empty()) return absl::StrCat("token \"", token_name, "\"");
      if (!cert_cn.empty()) return absl::StrCat("certificate CN \"", cert_cn, "\"");
      return "anonymous TCP client";
  }
  return "?";
}

bool Principal::SameAs(const Principal& other) const {
  if (via != other.via) return false;
  switch (via) {
    case Via::kInternal:
      return true;
    case Via::kUnixSocket:
      return peer.uid == other.peer.uid;
    case Via::kTcp:
      return token_name == other.token_name && cert_cn == other.cert_cn;
  }
  return false;
}

absl::StatusOr<ReaderList> ReaderList::Parse(absl::Span<const std::string> specs) {
  ReaderList out;
  for (const std::string& spec : specs) {
    for (absl::string_view raw : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
      absl::string_view entry = absl::StripAsciiWhitespace(raw);
      size_t colon = entry.find(':');
      if (colon == absl::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            "reader \"", entry, "\": expected uid:N, gid:N, token:NAME or cn:NAME"));
      }
      absl::string_view kind = entry.substr(0, colon);
      absl::string_view value = entry.substr(colon + 1);
      Rule rule{};
      if (kind == "uid" || kind == "gid") {
        rule.kind = kind == "uid" ? Rule::Kind::kUid : Rule::Kind::kGid;
        if (!absl::SimpleAtoi(value, &rule.id)) {
          return absl::InvalidArgumentError(
              absl::StrCat("reader \"", entry, "\": ", kind, " must be a number"));
        }
      } else if (kind == "token" || kind == "cn") {
        rule.kind = kind == "token" ? Rule::Kind::kToken : Rule::Kind::kCertCn;
        if (value.empty() || value.size() > 256) {
          return absl::InvalidArgumentError(absl::StrCat("reader \"", entry, "\": empty name"));
        }
        rule.name = std::string(value);
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "reader \"", entry, "\": unknown kind \"", kind, "\" (uid, gid, token or cn)"));
      }
      bool dup = std::any_of(out.rules_.begin(), out.rules_.end(), [&](const Rule& r) {
        return r.kind == rule.kind && r.id == rule.id && r.name == rule.name;
      });
      if (!dup) out.rules_.push_back(std::move(rule));
    }
  }
  return out;
}

bool ReaderList::Admits(const Principal& p) const {
  if (rules_.empty()) return true;
  for (const Rule& r : rules_) {
    switch (r.kind) {
      case Rule::Kind::kUid:
        if (p.via == Principal::Via::kUnixSocket && p.peer.uid == r.id) return true;
        break;
      case Rule::Kind::kGid:
        if (p.via == Principal::Via::kUnixSocket && p.peer.InGroup(r.id)) return true;
        break;
      case Rule::Kind::kToken:
        if (p.via == Principal::Via::kTcp && p.token_name == r.name) return true;
        break;
      case Rule::Kind::kCertCn:
        if (p.via == Principal::Via::kTcp && p.cert_cn == r.name) return true;
        break;
    }
  }
  return false;
}

bool ReaderList::OnlyTcpIdentities() const {
  return std::all_of(rules_.begin(), rules_.end(), [](const Rule& r) {
    return r.kind == Rule::Kind::kToken || r.kind == Rule::Kind::kCertCn;
  });
}

bool ReaderList::HasToken() const {
  return std::any_of(rules_.begin(), rules_.end(),
                     [](const Rule& r) { return r.kind == Rule::Kind::kToken; });
}

bool ReaderList::HasCertCn() const {
  return std::any_of(rules_.begin(), rules_.end(),
                     [](const Rule& r) { return r.kind == Rule::Kind::kCertCn; });
}

std::vector<std::string> ReaderList::ToStrings() const {
  std::vector<std::string> out;
  for (const Rule& r : rules_) {
    switch (r.kind) {
      case Rule::Kind::kUid: out.push_back(absl::StrCat("uid:", r.id)); break;
      case Rule::Kind::kGid: out.push_back(absl::StrCat("gid:", r.id)); break;
      case Rule::Kind::kToken: out.push_back(absl::StrCat("token:", r.name)); break;
      case Rule::Kind::kCertCn: out.push_back(absl::StrCat("cn:", r.name)); break;
    }
  }
  return out;
}

std::string ReadScope(absl::Span<const ReadGuard> guards) {
  // Length-prefixed, so that no name (a cn may hold any character but ',')
  // can make two different lists encode to the same scope.
  std::vector<std::string> lists;
  for (const ReadGuard& g : guards) {
    if (g.readers.empty()) continue;  // admits everyone: no condition
    std::vector<std::string> rules = g.readers.ToStrings();
    std::sort(rules.begin(), rules.end());
    rules.erase(std::unique(rules.begin(), rules.end()), rules.end());
    std::string list;
    for (const std::string& r : rules) absl::StrAppend(&list, r.size(), ":", r);
    lists.push_back(std::move(list));
  }
  std::sort(lists.begin(), lists.end());
  lists.erase(std::unique(lists.begin(), lists.end()), lists.end());
  std::string scope;
  for (const std::string& l : lists) absl::StrAppend(&scope, l.size(), "{", l, "}");
  return scope;
}

bool AccessPolicy::IsDaemonUid(const Principal& p) const {
  return p.via == Principal::Via::kUnixSocket && p.peer.uid == options_.daemon_uid;
}

absl::Status AccessPolicy::AdmitPeer(const Principal& p) const {
  if (p.via != Principal::Via::kUnixSocket) return absl::OkStatus();
  if (options_.allow_uids.empty() && options_.allow_gids.empty()) return absl::OkStatus();
  if (IsDaemonUid(p)) return absl::OkStatus();
  const auto& uids = options_.allow_uids;
  if (std::find(uids.begin(), uids.end(), p.peer.uid) != uids.end()) return absl::OkStatus();
  for (gid_t g : options_.allow_gids) {
    if (p.peer.InGroup(g)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      p.Describe(), " is not allowed to use this daemon (not in --allow-uid / --allow-gid)"));
}

absl::Status AccessPolicy::CheckAdmin(const Principal& p, absl::string_view action) const {
  if (p.via == Principal::Via::kInternal) return absl::OkStatus();
  if (options_.admin_uids.empty() && options_.admin_gids.empty() &&
      options_.admin_token_names.empty()) {
    return absl::OkStatus();
  }
  if (p.via == Principal::Via::kUnixSocket) {
    if (IsDaemonUid(p)) return absl::OkStatus();
    const auto& uids = options_.admin_uids;
    if (std::find(uids.begin(), uids.end(), p.peer.uid) != uids.end()) return absl::OkStatus();
    for (gid_t g : options_.admin_gids) {
      if (p.peer.InGroup(g)) return absl::OkStatus();
    }
  } else if (!p.token_name.empty()) {
    const auto& names = options_.admin_token_names;
    if (std::find(names.begin(), names.end(), p.token_name) != names.end()) {
      return absl::OkStatus();
    }
  }
  return absl::PermissionDeniedError(absl::StrCat(
      p.Describe(), " may not ", action,
      " (not in --admin-uid / --admin-gid / --admin-token-names)"));
}

absl::Status AccessPolicy::CheckFleetMember(const Principal& p) const {
  if (options_.fleet_members.empty()) {
    return absl::PermissionDeniedError(
        "the peer RPCs are off on this daemon: --fleet-members (token:NAME, cn:NAME) names the "
        "daemons that may load from it");
  }
  // A Unix-socket caller (a local admin, the daemon's own uid) is never a
  // fleet member: members are the identities peers present over --listen.
  if (p.via != Principal::Via::kTcp || !options_.fleet_members.Admits(p)) {
    return absl::PermissionDeniedError(
        absl::StrCat(p.Describe(), " is not a fleet member (--fleet-members)"));
  }
  return absl::OkStatus();
}

absl::Status AccessPolicy::CheckRead(const Principal& p,
                                     absl::Span<const ReadGuard> guards) const {
  if (p.via == Principal::Via::kInternal || IsDaemonUid(p)) return absl::OkStatus();
  for (const ReadGuard& g : guards) {
    if (!g.readers.Admits(p)) {
      return absl::PermissionDeniedError(
          absl::StrCat(p.Describe(), " is not a reader of ", g.what));
    }
  }
  return absl::OkStatus();
}

absl::Status AccessPolicy::CheckLeaseUse(const Principal& caller, uint64_t lease_id,
                                         const LeaseOwner& owner) const {
  if (caller.via == Principal::Via::kInternal || IsDaemonUid(caller)) return absl::OkStatus();
  if (caller.SameAs(owner.owner)) return absl::OkStatus();
  bool is_private = std::any_of(owner.guards.begin(), owner.guards.end(),
                                [](const ReadGuard& g) { return !g.readers.empty(); });
  bool comparable = caller.via == owner.owner.via;
  if ((is_private || !comparable) && CheckRead(caller, owner.guards).ok()) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat("lease ", lease_id, " was fetched by ",
                                                  owner.owner.Describe(), "; ", caller.Describe(),
                                                  " may not use it"));
}

absl::StatusOr<std::vector<uint32_t>> ParseIdList(absl::string_view flag, absl::string_view text) {
  std::vector<uint32_t> out;
  for (absl::string_view raw : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    absl::string_view v = absl::StripAsciiWhitespace(raw);
    uint32_t id = 0;
    if (!absl::SimpleAtoi(v, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": \"", v, "\" is not a numeric id"));
    }
    out.push_back(id);
  }
  return out;
}

absl::StatusOr<BearerTokens> BearerTokens::Parse(absl::string_view text,
                                                 absl::string_view origin) {
  BearerTokens out;
  int number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++number;
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    Entry e;
    if (words.size() == 1) {
      e.name = absl::StrCat("token-", number);
      e.token = std::string(words[0]);
    } else if (words.size() == 2) {
      if (!ValidName(words[0])) {
        return absl::InvalidArgumentError(absl::StrCat(
            origin, ":", number, ": token name may hold only letters, digits and . _ @ -"));
      }
      e.name = std::string(words[0]);
      e.token = std::string(words[1]);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ":", number, ": expected TOKEN or NAME TOKEN"));
    }
    if (e.token.size() < kMinTokenLength) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ":", number, ": token is shorter than ",
                                                     kMinTokenLength, " characters"));
    }
    for (const Entry& prev : out.entries_) {
      if (prev.token == e.token) {
        return absl::InvalidArgumentError(absl::StrCat(origin, ":", number, ": duplicate token"));
      }
      if (prev.name == e.name) {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, ":", number, ": duplicate token name \"", e.name, "\""));
      }
    }
    out.entries_.push_back(std::move(e));
  }
  if (out.entries_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": no tokens"));
  }
  return out;
}

absl::StatusOr<BearerTokens> BearerTokens::Load(const std::string& path) {
  auto text = ReadFileToString(path, kMaxTokenFileBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("token file ", path, ": ", text.status().message()));
  }
  return Parse(*text, path);
}

absl::StatusOr<std::string> BearerTokens::Authenticate(
    std::optional<absl::string_view> authorization) const {
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "missing bearer token (metadata \"authorization: Bearer <token>\")");
  }
  absl::string_view v = absl::StripAsciiWhitespace(*authorization);
  constexpr absl::string_view kScheme = "bearer ";
  if (v.size() <= kScheme.size() || !absl::EqualsIgnoreCase(v.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError("authorization metadata is not \"Bearer <token>\"");
  }
  absl::string_view presented = absl::StripAsciiWhitespace(v.substr(kScheme.size()));
  const Entry* match = nullptr;
  for (const Entry& e : entries_) {  // no early exit
    if (ConstantTimeEquals(e.token, presented)) match = &e;
  }
  if (match == nullptr) return absl::UnauthenticatedError("invalid bearer token");
  return match->name;
}

}  // namespace weightd
