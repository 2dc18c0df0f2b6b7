#include "server/fleet/peer_channels.h"

#include <algorithm>
#include <climits>

#include <grpcpp/client_context.h>
#include <grpcpp/support/channel_arguments.h>

#include "common/grpc/credentials.h"

namespace weightd {

bool AnsweredBy(const grpc::ClientContext& ctx, absl::string_view instance_id) {
  const auto& md = ctx.GetServerInitialMetadata();
  auto it = md.find(kInstanceMetadata);
  return it != md.end() && absl::string_view(it->second.data(), it->second.size()) == instance_id;
}

PeerChannels::PeerChannels(size_t capacity, uint64_t receive_budget,
                           std::shared_ptr<grpc::ChannelCredentials> creds, std::string token)
    : capacity_(std::max<size_t>(1, capacity)),
      creds_(std::move(creds)),
      token_(std::move(token)),
      max_message_(static_cast<int>(std::min<uint64_t>(receive_budget, INT32_MAX))),
      quota_("weightd-peers") {
  quota_.Resize(static_cast<size_t>(receive_budget));
}

std::shared_ptr<v1::Models::Stub> PeerChannels::StubFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto it = stubs_.find(address);
  if (it != stubs_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.second);
    return it->second.first;
  }
  grpc::ChannelArguments args;
  // A peer that went away is tried again at the next poll, not after
  // gRPC's reconnect backoff (up to 2 min).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  // Its own subchannels: an evicted channel's connection closes with it.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // What a peer sends is buffered within the budget (gRPC checks a
  // message's size only once it has it all: the quota is what bounds
  // the memory); no message may be larger than all of it.
  args.SetResourceQuota(quota_);
  args.SetMaxReceiveMessageSize(max_message_);
  auto stub = std::shared_ptr<v1::Models::Stub>(
      v1::Models::NewStub(CreateChannelWithToken(address, creds_, args, token_)));
  lru_.push_front(address);
  stubs_[address] = {stub, lru_.begin()};
  while (stubs_.size() > capacity_) {
    stubs_.erase(lru_.back());
    lru_.pop_back();
  }
  return stub;
}

void PeerChannels::KeepOnly(const std::vector<std::string>& keep) {
  absl::MutexLock lock(&mu_);
  for (auto it = stubs_.begin(); it != stubs_.end();) {
    auto cur = it++;
    if (std::find(keep.begin(), keep.end(), cur->first) == keep.end()) {
      lru_.erase(cur->second.second);
      stubs_.erase(cur);
    }
  }
}

}  // namespace weightd
