// The weightd.v1 services on gRPC's callback API: Models (declared in
// models_service_impl.h, defined by concern in model_calls.cc,
// publish_calls.cc and fleet_calls.cc), Shards (shards_service.cc) and
// Adapters (adapters_service.cc). Thin: every call is authenticated
// (call_auth.h), translated (proto_convert.h) and handed to WeightService;
// blocking work runs on the worker pool or a capped thread (reactors.h),
// never on gRPC's own threads. GrpcServer owns them.
#ifndef WEIGHTD_SERVER_GRPC_SERVICES_H_
#define WEIGHTD_SERVER_GRPC_SERVICES_H_

#include <memory>

#include <grpcpp/impl/service_type.h>

#include "server/base/thread_pool.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/call_drain.h"
#include "server/engine/weight_service.h"

namespace weightd {

class PeerTable;

// What every service borrows from the server (all outlive the services).
struct ServiceContext {
  WeightService* service;
  ThreadPool* pool;           // short calls
  TaskThreads* long_calls;   // loads and watch streams: a thread each, joined at shutdown
  CallDrain* drain;
  const CallAuthenticator* auth;
  const PeerTable* peers = nullptr;  // --peers; null: none
};

std::unique_ptr<grpc::Service> MakeModelsService(const ServiceContext& c);
// `max_watch_streams`: Watch streams open at once (each holds a thread).
std::unique_ptr<grpc::Service> MakeShardsService(const ServiceContext& c, int max_watch_streams);
std::unique_ptr<grpc::Service> MakeAdaptersService(const ServiceContext& c);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_SERVICES_H_
