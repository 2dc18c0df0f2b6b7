// --peer-transport's values (ucx_plane.h), built with or without UCX.
#include "absl/strings/str_cat.h"
#include "server/fleet/ucx_plane.h"

namespace weightd {

absl::StatusOr<PeerTransport> ParsePeerTransport(absl::string_view s) {
  if (s == "grpc") return PeerTransport::kGrpc;
  if (s == "auto") return PeerTransport::kAuto;
  if (s == "ucx") return PeerTransport::kUcx;
  return absl::InvalidArgumentError(
      absl::StrCat("--peer-transport: expected auto, ucx or grpc, got \"", s, "\""));
}

const char* PeerTransportName(PeerTransport t) {
  switch (t) {
    case PeerTransport::kGrpc: return "grpc";
    case PeerTransport::kAuto: return "auto";
    case PeerTransport::kUcx: return "ucx";
  }
  return "?";
}

}  // namespace weightd
