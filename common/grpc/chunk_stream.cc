#include "common/grpc/chunk_stream.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/grpc/status_convert.h"

namespace weightd {

absl::Status ReadChunksInto(grpc::ClientContext& ctx,
                            grpc::ClientReaderInterface<v1::ReadChunk>& reader, uint64_t length,
                            uint8_t* dest, const ChunkSender& sender) {
  v1::ReadChunk chunk;
  uint64_t pos = 0;
  absl::Status bad;
  while (reader.Read(&chunk)) {
    if (chunk.offset() != pos || chunk.data().size() > length - pos) {
      bad = absl::DataLossError(absl::StrCat(sender.name, " sent bytes ", chunk.offset(), "+",
                                             chunk.data().size(), " of a range of ", length,
                                             " where ", pos, " was next"));
      ctx.TryCancel();
      // What was already on its way is drained unread (Finish wants the
      // stream read to its end); the cancel ends it soon.
      while (reader.Read(&chunk)) {
      }
      break;
    }
    if (!chunk.data().empty()) std::memcpy(dest + pos, chunk.data().data(), chunk.data().size());
    pos += chunk.data().size();
  }
  const grpc::Status finished = reader.Finish();
  if (!bad.ok()) return bad;
  if (!finished.ok()) return FromGrpc(finished, sender.call_context);
  if (pos != length) {
    return absl::DataLossError(
        absl::StrCat(sender.name, " sent ", pos, " of ", length, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace weightd
