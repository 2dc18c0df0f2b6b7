#include "server/gpu/gpu_devices.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/gpu/cuda_plugin.h"

namespace weightd {

absl::StatusOr<const CudaPluginApi*> LoadCudaPlugin() {
  static const absl::StatusOr<const CudaPluginApi*> loaded =
      []() -> absl::StatusOr<const CudaPluginApi*> {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("WEIGHTD_CUDA_PLUGIN"); env != nullptr && *env != '\0') {
      candidates.push_back(env);
    } else {
      char exe[4096];
      ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
      if (n > 0) {
        std::string dir(exe, static_cast<size_t>(n));
        dir = dir.substr(0, dir.rfind('/'));
        candidates.push_back(dir + "/libweightd_cuda_plugin.so");
        candidates.push_back(dir + "/../lib/weightd/libweightd_cuda_plugin.so");
      }
    }
    std::vector<std::string> why;
    for (const std::string& path : candidates) {
      void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        const char* err = ::dlerror();
        why.push_back(err != nullptr ? err : path);
        continue;
      }
      auto entry = reinterpret_cast<const CudaPluginApi* (*)()>(
          ::dlsym(handle, "weightd_cuda_plugin_api"));
      const CudaPluginApi* api = entry != nullptr ? entry() : nullptr;
      if (api == nullptr || api->abi != kCudaPluginAbi || api->set_event_sink == nullptr ||
          api->discover == nullptr || api->push == nullptr || api->pin == nullptr ||
          api->unpin == nullptr || api->export_fill == nullptr ||
          api->export_release == nullptr) {
        why.push_back(absl::StrCat(path, ": not a weightd CUDA plugin of ABI ", kCudaPluginAbi));
        continue;  // the handle stays open: harmless
      }
      api->set_event_sink(&LogEvent);
      return api;
    }
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA plugin cannot be loaded: ", absl::StrJoin(why, "; ")));
  }();
  return loaded;
}

GpuInventory DiscoverGpus() {
#ifdef WEIGHTD_HAVE_CUDA
  absl::StatusOr<const CudaPluginApi*> api = LoadCudaPlugin();
  if (!api.ok()) {
    GpuInventory inv;
    inv.cuda_built = true;
    inv.unavailable = std::string(api.status().message());
    return inv;
  }
  return (*api)->discover();
#else
  GpuInventory inv;
  inv.unavailable = "this weightd was built without CUDA (WEIGHTD_CUDA=OFF or no nvcc)";
  return inv;
#endif
}

}  // namespace weightd
