// Reading a stream of weightd.v1.ReadChunk messages (Shards.Read: the grpc
// transport of the C++ client; Models.ReadCheckpoint: the daemon's fleet
// client loading from a peer) into memory the caller owns. The one chunk
// loop both use, so that both give the same code for the same failure:
//
//   the chunks of a range of `length` bytes come in order, each starting
//   where the previous one ended (ReadChunk.offset, relative to the range),
//   and together they are exactly the range. A chunk that is out of order
//   or runs past the range is DATA_LOSS (the bytes are not what was
//   promised) and the call is cancelled at once; a stream that ends short
//   is DATA_LOSS too; a call that fails carries the sender's code (gRPC's
//   RESOURCE_EXHAUSTED for a message over the channel's receive limit,
//   CANCELLED, DEADLINE_EXCEEDED, or the daemon's own).
//
// Nothing is written outside dest[0, length), whatever the sender does.
// Stateless; thread-safe for distinct calls.
#ifndef WEIGHTD_COMMON_GRPC_CHUNK_STREAM_H_
#define WEIGHTD_COMMON_GRPC_CHUNK_STREAM_H_

#include <cstdint>
#include <string>

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/status/status.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// Who sends a chunk stream, for messages.
struct ChunkSender {
  // As messages name it: "peer 10.0.0.2:7070", "the daemon (segment 2)".
  std::string name;
  // Put before the call's own failure ("reading from peer 10.0.0.2:7070:
  // ..."); empty: the sender's message as it is.
  std::string call_context;
};

// Reads the whole stream of `reader` (a call made with `ctx`) into
// dest[0, length) and finishes the call. OK once exactly `length` bytes
// arrived in order; the errors above otherwise. REQUIRES: `reader` has not
// been read; dest has room for `length` bytes.
absl::Status ReadChunksInto(grpc::ClientContext& ctx,
                            grpc::ClientReaderInterface<v1::ReadChunk>& reader, uint64_t length,
                            uint8_t* dest, const ChunkSender& sender);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_GRPC_CHUNK_STREAM_H_
