#include "server/grpc/grpc_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <deque>
#include <mutex>
#include <utility>

#include <grpc/grpc.h>
#include <grpcpp/support/byte_buffer.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/fd.h"
#include "common/grpc/status_convert.h"
#include "server/base/log.h"
#include "common/status_macros.h"
#include "server/base/thread_pool.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/call_drain.h"
#include "server/grpc/services.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

class GrpcServer::Impl {
 public:
  Impl(GrpcServerOptions options, WeightService* service,
       std::shared_ptr<const BearerTokens> tokens)
      : options_(std::move(options)),
        pool_(options_.worker_threads),
        auth_(&service->access(), &peers_, std::move(tokens), &drain_),
        models_(MakeModelsService({PartsOf(service), &pool_, &long_calls_, &drain_, &auth_,
                                   options_.peers, options_.ucx, options_.peer_client})),
        shards_(MakeShardsService({PartsOf(service), &pool_, &long_calls_, &drain_, &auth_},
                                  options_.max_watch_streams)),
        adapters_(MakeAdaptersService({PartsOf(service), &pool_, &long_calls_, &drain_, &auth_})) {}

  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials() {
    if (options_.tls_cert_file.empty()) return grpc::InsecureServerCredentials();
    constexpr uint64_t kMaxPem = 1 << 20;
    auto read = [&](const std::string& path, const char* what) -> absl::StatusOr<std::string> {
      auto text = ReadFileToString(path, kMaxPem);
      if (!text.ok()) {
        return absl::Status(text.status().code(),
                            absl::StrCat(what, " ", path, ": ", text.status().message()));
      }
      return text;
    };
    WD_ASSIGN_OR_RETURN(std::string cert, read(options_.tls_cert_file, "--tls-cert"));
    WD_ASSIGN_OR_RETURN(std::string key, read(options_.tls_key_file, "--tls-key"));
    grpc::SslServerCredentialsOptions ssl(
        options_.tls_client_ca_file.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_key_cert_pairs.push_back({key, cert});
    if (!options_.tls_client_ca_file.empty()) {
      WD_ASSIGN_OR_RETURN(ssl.pem_root_certs, read(options_.tls_client_ca_file, "--tls-client-ca"));
    }
    return grpc::SslServerCredentials(ssl);
  }

  absl::Status Start() {
    drain_.SetClosed(options_.closed_at_start);
    drain_.SetChangesClosed(options_.changes_closed_at_start);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    // The Unix socket is accepted by UnixGrpcAcceptor (peer credentials).
    int tcp_port = 0;
    if (!options_.tcp_listen.empty()) {
      WD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> creds, TcpCredentials());
      builder.AddListeningPort(options_.tcp_listen, creds, &tcp_port);
    }
    builder.SetMaxSendMessageSize(256 << 20);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(models_.get());
    builder.RegisterService(shards_.get());
    builder.RegisterService(adapters_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot start the gRPC server",
                                                 options_.tcp_listen.empty() ? "" : " on ",
                                                 options_.tcp_listen));
    }
    if (!options_.tcp_listen.empty() && tcp_port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.tcp_listen));
    }
    auto acceptor = UnixGrpcAcceptor::Start(options_.unix_socket, options_.unix_socket_mode,
                                            server_.get(), &peers_,
                                            options_.adopt_unix_listen_fd);
    options_.adopt_unix_listen_fd = -1;
    if (!acceptor.ok()) {
      return absl::Status(acceptor.status().code(),
                          absl::StrCat("cannot listen on unix:", options_.unix_socket, ": ",
                                       acceptor.status().message()));
    }
    acceptor_ = std::move(*acceptor);
    server_->GetHealthCheckService()->SetServingStatus(options_.closed_at_start.ok());
    return absl::OkStatus();
  }

  void SetRestoring(absl::Status why) {
    const bool open = why.ok();
    drain_.SetChangesClosed(why);
    drain_.SetClosed(std::move(why));
    absl::MutexLock lock(&mu_);
    if (!shut_down_ && server_ != nullptr) {
      server_->GetHealthCheckService()->SetServingStatus(open);
    }
  }

  // A server that failed to start after it began serving (GrpcServer::Start)
  // is shut down here: its load and watch threads end and are joined
  // before the services they use are destroyed.
  ~Impl() { Shutdown(absl::ZeroDuration()); }

  void Shutdown(absl::Duration grace) {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    // New calls, also on connections already open, get UNAVAILABLE; health
    // says NOT_SERVING; no new connections.
    drain_.BeginDrain();
    if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(false);
    if (acceptor_ != nullptr) acceptor_->Stop();  // unlinks the socket
    if (server_ == nullptr) return;
    // In-flight calls get `grace` (watches end within 500 ms).
    const absl::Time deadline = absl::Now() + grace;
    int64_t left = drain_.WaitIdle(deadline);
    if (left > 0) {
      LogEvent(LogLevel::kWarning, "shutdown_grace_expired",
               {{"calls_in_flight", absl::StrCat(left)}, {"cancelled", "true"}});
    }
    // An expired deadline: gRPC cancels what is left and closes the idle
    // connections instead of waiting for their clients to close them.
    server_->Shutdown(std::chrono::system_clock::now());
    // A cancelled load or watch thread still runs until it notices; the
    // services must outlive it: every one is joined here.
    drain_.WaitIdle(absl::InfiniteFuture());
    long_calls_.JoinAll();
  }

  void Wait() { server_->Wait(); }

  CallDrain& drain() { return drain_; }
  UnixGrpcAcceptor* acceptor() { return acceptor_.get(); }

 private:
  GrpcServerOptions options_;
  ThreadPool pool_;
  TaskThreads long_calls_;  // Load and Watch; joined by Shutdown()
  CallDrain drain_;
  UnixPeerRegistry peers_;
  CallAuthenticator auth_;
  std::unique_ptr<grpc::Service> models_;
  std::unique_ptr<grpc::Service> shards_;
  std::unique_ptr<grpc::Service> adapters_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<UnixGrpcAcceptor> acceptor_;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(GrpcServerOptions options,
                                                              WeightService* service) {
  // gRPC's library-wide teardown (the last grpc_shutdown(), run by the
  // server's destructor) waits for its timer threads to be counted out, and
  // a timer thread it failed to start at the process's thread limit (pids
  // cgroup, TasksMax, RLIMIT_NPROC) is never counted out: the daemon would
  // hang at exit. So the library stays initialized for the life of the
  // process, which hands everything back to the kernel when it exits.
  static const bool kLibraryHeld = [] {
    grpc_init();
    return true;
  }();
  (void)kLibraryHeld;
  std::shared_ptr<const BearerTokens> tokens;
  if (!options.auth_token_file.empty()) {
    WD_ASSIGN_OR_RETURN(BearerTokens loaded, BearerTokens::Load(options.auth_token_file));
    tokens = std::make_shared<const BearerTokens>(std::move(loaded));
  }
  auto impl = std::make_unique<Impl>(std::move(options), service, std::move(tokens));
  absl::Status s = impl->Start();
  if (!s.ok()) return s;
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcServer::~GrpcServer() { Shutdown(absl::Seconds(5)); }
void GrpcServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
void GrpcServer::Wait() { impl_->Wait(); }
void GrpcServer::Restoring(absl::Status why) { impl_->SetRestoring(std::move(why)); }
void GrpcServer::Restored() { impl_->SetRestoring(absl::OkStatus()); }
void GrpcServer::CloseChanges(absl::Status why) { impl_->drain().SetChangesClosed(std::move(why)); }
int64_t GrpcServer::WaitChangesIdle(absl::Time deadline) {
  return impl_->drain().WaitChangesIdle(deadline);
}
void GrpcServer::PauseAccepting() { impl_->acceptor()->Pause(); }
void GrpcServer::ResumeAccepting() { impl_->acceptor()->Resume(); }
void GrpcServer::KeepSocketFile(bool keep) { impl_->acceptor()->KeepSocketFile(keep); }
int GrpcServer::unix_listen_fd() const { return impl_->acceptor()->listen_fd(); }

}  // namespace weightd
