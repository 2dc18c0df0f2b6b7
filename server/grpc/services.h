// The weightd.v1 services on gRPC's callback API: Models (declared in
// models_service_impl.h, defined by concern in model_calls.cc,
// publish_calls.cc and fleet_calls.cc), Shards (shards_service.cc) and
// Adapters (adapters_service.cc). Thin: every call is authenticated
// (call_auth.h), translated (proto_convert.h) and handed to
// the engine part that serves it (EngineParts);
// blocking work runs on the worker pool or a capped thread (reactors.h),
// never on gRPC's own threads. GrpcServer owns them.
#ifndef WEIGHTD_SERVER_GRPC_SERVICES_H_
#define WEIGHTD_SERVER_GRPC_SERVICES_H_

#include <memory>
#include <string>

#include <grpcpp/impl/service_type.h>

#include "server/base/thread_pool.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/call_drain.h"
#include "server/engine/weight_service.h"

namespace weightd {

class PeerTable;
class UcxPlane;
class PeerCheckpointClient;

// The engine's parts the services call, each service taking only those
// it uses (borrowed from the WeightService, which outlives them).
struct EngineParts {
  ModelService* models;
  AdapterService* adapters;
  FetchService* fetches;
  PublishService* publishes;
  ResidentCopies* copies;            // what peers find and read here
  const ServiceStatsSource* stats;   // Models.Stats
  // Told to publishers with their session (BeginPublish).
  std::string data_socket_path;
  std::string data_socket_name;
};
inline EngineParts PartsOf(WeightService* service) {
  return EngineParts{service->models(),       service->adapters(),
                     service->fetches(),      service->publishes(),
                     service->copies(),       service,
                     service->options().data_socket_path,
                     service->options().data_socket_name};
}

// What every service borrows from the server (all outlive the services).
struct ServiceContext {
  EngineParts engine;
  ThreadPool* pool;           // short calls
  TaskThreads* long_calls;   // loads and watch streams: a thread each, joined at shutdown
  CallDrain* drain;
  const CallAuthenticator* auth;
  const PeerTable* peers = nullptr;  // --peers; null: none
  UcxPlane* ucx = nullptr;  // --peer-transport auto|ucx; null: none
  const PeerCheckpointClient* peer_client = nullptr;  // per-transport reads; null: no peers
};

std::unique_ptr<grpc::Service> MakeModelsService(const ServiceContext& c);
// `max_watch_streams`: Watch streams open at once (each holds a thread).
std::unique_ptr<grpc::Service> MakeShardsService(const ServiceContext& c, int max_watch_streams);
std::unique_ptr<grpc::Service> MakeAdaptersService(const ServiceContext& c);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_SERVICES_H_
