#include "server/grpc/proto_convert.h"

#include <memory>
#include <mutex>
#include <vector>

#include <grpcpp/support/slice.h>

#include "absl/strings/str_cat.h"
#include "proto/convert/dtype_convert.h"

namespace weightd {

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  std::optional<DType> d = DTypeFromProto(dtype);
  if (!d.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype enum value ", static_cast<int>(dtype)));
  }
  return *d;
}

LoadSource FromProtoLoadSource(v1::LoadSource source) {
  switch (source) {
    case v1::LOAD_SOURCE_STORAGE: return LoadSource::kStorage;
    case v1::LOAD_SOURCE_PEERS: return LoadSource::kPeers;
    default: return LoadSource::kAuto;
  }
}

void FillModelInfo(const ModelSummary& s, v1::ModelInfo* out) {
  out->set_name(s.name);
  out->set_path(s.path);
  out->set_generation(s.generation);
  out->set_tensor_count(s.tensor_count);
  out->set_total_bytes(s.total_bytes);
  out->set_segment_bytes_4k(s.page_bytes[static_cast<size_t>(PageKind::kSmall)]);
  out->set_segment_bytes_thp(s.page_bytes[static_cast<size_t>(PageKind::kTransparentHuge)]);
  out->set_segment_bytes_hugetlb(s.page_bytes[static_cast<size_t>(PageKind::kHugetlb)]);
  out->set_weights_id(s.content.Hex());
  for (const std::string& f : s.files) out->add_files(f);
  for (const std::string& a : s.adapters) out->add_adapters(a);
  for (const std::string& r : s.report) out->add_report(r);
  for (const std::string& r : s.readers) out->add_readers(r);
}

void FillAdapterInfo(const AdapterSummary& a, v1::AdapterInfo* out) {
  out->set_name(a.name);
  out->set_path(a.path);
  out->set_format(a.format);
  out->set_tensor_count(a.tensor_count);
  out->set_bytes(a.bytes);
  for (const std::string& i : a.ignored) out->add_ignored(i);
  for (const std::string& r : a.readers) out->add_readers(r);
}

absl::StatusOr<FetchParams> DecodeFetch(const v1::FetchRequest& req) {
  FetchParams p;
  p.model = req.model();
  p.generation = req.generation();
  p.mesh.shape.assign(req.mesh_shape().begin(), req.mesh_shape().end());
  p.mesh.coord.assign(req.coord().begin(), req.coord().end());
  if (p.mesh.shape.empty()) {
    p.mesh.shape = {1};
    if (p.mesh.coord.empty()) p.mesh.coord = {0};
  }
  if (req.placements_size() > 0) {
    std::vector<Placement> pl;
    for (const v1::Placement& x : req.placements()) {
      if (x.shard_dim() < -1) {
        return absl::InvalidArgumentError(absl::StrCat("bad placement shard_dim ", x.shard_dim()));
      }
      pl.push_back(Placement{x.shard_dim()});
    }
    p.placements = std::move(pl);
  }
  if (req.dtype() != v1::DTYPE_UNSPECIFIED) {
    auto d = FromProtoDType(req.dtype());
    if (!d.ok()) return d.status();
    p.dtype = *d;
  }
  p.names.assign(req.names().begin(), req.names().end());
  switch (req.transport()) {
    case v1::TRANSPORT_UNSPECIFIED:
    case v1::SHM: p.transport = TransportKind::kShm; break;
    case v1::GRPC: p.transport = TransportKind::kGrpc; break;
    case v1::CUDA: p.transport = TransportKind::kCuda; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown transport ", req.transport()));
  }
  p.changed_since = req.changed_since();
  p.defer_casts = req.defer_casts();
  p.defer_merges = req.defer_casts() && req.defer_merges();
  if (p.defer_casts && p.transport == TransportKind::kGrpc) {
    return absl::InvalidArgumentError(
        "defer_casts leases tensors for a push over the data socket (transport shm); a grpc "
        "transport Reads its bytes, which such a lease refuses");
  }
  return p;
}

// The FetchResponse of `table` without lease_id and token (fields 1 and 2),
// serialized once per table: protobuf merges concatenated messages, so a
// response is the per-lease head followed by these bytes.
const std::string& EncodedTable(const FetchTable& table) {
  std::call_once(table.wire_once, [&table] {
    v1::FetchResponse body;
    body.set_generation(table.generation);
    body.set_data_socket(table.data_socket);
    body.set_data_socket_name(table.data_socket_name);
    body.set_weights_id(table.weights_id);
    for (uint64_t s : table.segment_sizes) body.add_segment_sizes(s);
    for (const FetchedTensor& t : table.tensors) {
      v1::ShardTensor* st = body.add_tensors();
      st->set_name(t.name);
      st->set_dtype(ToProtoDType(t.dtype));
      for (int64_t d : t.shape) st->add_shape(d);
      for (int64_t d : t.global_shape) st->add_global_shape(d);
      for (int64_t d : t.global_offset) st->add_global_offset(d);
      st->set_segment(t.segment);
      st->set_offset(t.offset);
      st->set_length(t.length);
      if (t.cast_on_push) {
        st->set_cast_on_push(true);
      } else {
        st->set_digest(std::string(t.digest.View()));
      }
    }
    body.SerializeToString(&table.wire);
  });
  return table.wire;
}

namespace {

void ReleaseTable(void* table) { delete static_cast<std::shared_ptr<const FetchTable>*>(table); }

// The response bytes: a fresh head (lease id, token) and the table's shared
// encoding, sent without a copy (the slice keeps the table alive).
grpc::ByteBuffer EncodeFetchResponse(const FetchResult& result) {
  v1::FetchResponse head;
  head.set_lease_id(result.lease.id);
  head.set_token(std::string(reinterpret_cast<const char*>(result.lease.token.data()),
                             result.lease.token.size()));
  std::string head_bytes = head.SerializeAsString();
  const std::string& body = EncodedTable(*result.table);
  grpc::Slice slices[2] = {
      grpc::Slice(head_bytes),
      grpc::Slice(const_cast<char*>(body.data()), body.size(), &ReleaseTable,
                  new std::shared_ptr<const FetchTable>(result.table))};
  return grpc::ByteBuffer(slices, 2);
}

}  // namespace

// A fetch's outcome as the call's response (or its error).
absl::Status EncodeFetchResponse(const absl::StatusOr<FetchResult>& result,
                                 grpc::ByteBuffer* resp) {
  if (!result.ok()) return result.status();
  *resp = EncodeFetchResponse(*result);
  return absl::OkStatus();
}

absl::StatusOr<v1::FetchRequest> ParseFetchRequest(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  v1::FetchRequest req;
  std::string bytes;
  if (buffer.Dump(&slices).ok()) {
    for (const grpc::Slice& sl : slices) {
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
    if (req.ParseFromString(bytes)) return req;
  }
  return absl::InvalidArgumentError("malformed FetchRequest");
}

}  // namespace weightd
