// The weightd.v1 Models service (MakeModelsService, services.h), declared
// once and defined by concern in three files:
//   model_calls.cc    model administration and reads: Load, Unload, List,
//                     Get, Verify, Stats
//   publish_calls.cc  publishing new base weights: BeginPublish,
//                     PublishWrite, CommitPublish, AbortPublish
//   fleet_calls.cc    daemon to daemon: Peers, FindCheckpoint,
//                     ReadCheckpoint
// Internal to server/grpc: only those files include it.
//
// Who may call what (call_auth.h authenticates; AccessPolicy decides): each
// declaration below says it. "Any caller" is one CallAuthenticator::
// Authenticate accepts (an allowed Unix peer, a TCP caller with a valid
// token); what it then sees is still cut to what it may read.
//
// Thread-safe: gRPC calls the methods on its threads; blocking work runs on
// the worker pool or a long-call thread (reactors.h). Owns nothing but
// the data socket's names; every pointer is borrowed (the engine's parts
// from WeightService, the rest from GrpcServer) and outlives the service.
#ifndef WEIGHTD_SERVER_GRPC_MODELS_SERVICE_IMPL_H_
#define WEIGHTD_SERVER_GRPC_MODELS_SERVICE_IMPL_H_

#include <grpcpp/grpcpp.h>

#include "server/base/thread_pool.h"
#include "server/grpc/services.h"
#include "server/fleet/peer_table.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/call_drain.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

class PeerCheckpointClient;
class UcxPlane;

class ModelsImpl final : public v1::Models::CallbackService {
 public:
  ModelsImpl(const EngineParts& engine, ThreadPool* pool, TaskThreads* long_calls,
             CallDrain* drain, const CallAuthenticator* auth, const PeerTable* peers,
             UcxPlane* ucx, const PeerCheckpointClient* peer_client)
      : models_(engine.models),
        publishes_(engine.publishes),
        copies_(engine.copies),
        stats_(engine.stats),
        data_socket_path_(engine.data_socket_path),
        data_socket_name_(engine.data_socket_name),
        pool_(pool),
        long_calls_(long_calls),
        drain_(drain),
        auth_(auth),
        peers_(peers),
        ucx_(ucx),
        peer_client_(peer_client) {}

  // --- Model administration and reads (model_calls.cc). ---

  // Admins ("load models"). A stream of progress on a thread of its own.
  grpc::ServerWriteReactor<v1::LoadProgress>* Load(grpc::CallbackServerContext* ctx,
                                                   const v1::LoadRequest* req) override;
  // Admins ("unload models").
  grpc::ServerUnaryReactor* Unload(grpc::CallbackServerContext* ctx, const v1::UnloadRequest* req,
                                   v1::UnloadResponse* resp) override;
  // Any caller; lists only the models it may read.
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx, const v1::ListModelsRequest* req,
                                 v1::ListModelsResponse* resp) override;
  // Any caller that may read the model.
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::GetModelRequest* req,
                                v1::ModelInfo* resp) override;
  // Any caller that may read the model.
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* ctx, const v1::VerifyRequest* req,
                                   v1::VerifyResponse* resp) override;
  // Any caller (daemon-wide counters and the GPU inventory, no names).
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* req,
                                  v1::StatsResponse* resp) override;

  // --- Publishing (publish_calls.cc). Admins only ("publish weights"). ---

  grpc::ServerUnaryReactor* BeginPublish(grpc::CallbackServerContext* ctx,
                                         const v1::BeginPublishRequest* req,
                                         v1::PublishSession* resp) override;
  grpc::ServerReadReactor<v1::PublishChunk>* PublishWrite(grpc::CallbackServerContext* ctx,
                                                          v1::PublishWriteResponse* resp) override;
  grpc::ServerUnaryReactor* CommitPublish(grpc::CallbackServerContext* ctx,
                                          const v1::CommitPublishRequest* req,
                                          v1::PublishResult* resp) override;
  grpc::ServerUnaryReactor* AbortPublish(grpc::CallbackServerContext* ctx,
                                         const v1::AbortPublishRequest* req,
                                         v1::AbortPublishResponse* resp) override;

  // --- Daemon to daemon (fleet_calls.cc). ---

  // Any caller; what the peers hold only for admins ("see what peers hold").
  grpc::ServerUnaryReactor* Peers(grpc::CallbackServerContext* ctx, const v1::PeersRequest* req,
                                  v1::PeersResponse* resp) override;
  // Fleet members only (AccessPolicy::CheckFleetMember), checked before the
  // request is looked at; a copy is offered only where the caller may read.
  grpc::ServerUnaryReactor* FindCheckpoint(grpc::CallbackServerContext* ctx,
                                           const v1::FindCheckpointRequest* req,
                                           v1::FindCheckpointResponse* resp) override;
  // Fleet members only, for a copy FindCheckpoint offered them.
  grpc::ServerWriteReactor<v1::ReadChunk>* ReadCheckpoint(
      grpc::CallbackServerContext* ctx, const v1::ReadCheckpointRequest* req) override;

 private:
  // Answers carry this daemon's instance id (PeerTable::instance_id), so
  // that a daemon that finds itself among its peers (--peer-dns naming it)
  // knows and leaves itself out.
  void SayWhoAnswers(grpc::CallbackServerContext* ctx) const {
    if (peers_ != nullptr) ctx->AddInitialMetadata(kInstanceMetadata, peers_->instance_id());
  }

  // Constant after construction (borrowed but the two names).
  ModelService* const models_;
  PublishService* const publishes_;
  ResidentCopies* const copies_;  // what peers find and read here
  const ServiceStatsSource* const stats_;
  const std::string data_socket_path_;  // told to publishers (BeginPublish)
  const std::string data_socket_name_;
  ThreadPool* const pool_;
  TaskThreads* const long_calls_;
  CallDrain* const drain_;
  const CallAuthenticator* const auth_;
  const PeerTable* const peers_;  // --peers; null: none
  UcxPlane* const ucx_;            // FindCheckpoint's UCX grants (ucx_offer.h); null: none
  const PeerCheckpointClient* const peer_client_;  // Stats.peer_transports; null: no peers
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_MODELS_SERVICE_IMPL_H_
