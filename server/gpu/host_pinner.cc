#include "server/gpu/host_pinner.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/base/log.h"

namespace weightd {

absl::string_view PinMethodName(PinMethod method) {
  switch (method) {
    case PinMethod::kReadOnly: return "read_only";
    case PinMethod::kWritable: return "writable";
    case PinMethod::kNone: break;
  }
  return "none";
}

PinPlan ChoosePinPlan(PinMode mode, const GpuInventory& gpus) {
  PinPlan plan;
  if (mode == PinMode::kOff) return plan;
  if (gpus.devices.empty()) {
    // auto: nothing to say; on: the operator asked, say why not.
    plan.reason = gpus.unavailable;
    plan.log_skips = mode == PinMode::kOn;
    return plan;
  }
  bool read_only = true;
  for (const GpuDevice& g : gpus.devices) {
    if (!g.host_register) {
      plan.reason = absl::StrCat("GPU ", g.uuid, " (", g.name,
                                 ") registers no host memory (cudaDevAttrHostRegisterSupported 0)");
      plan.log_skips = true;
      return plan;
    }
    read_only = read_only && g.host_register_read_only;
  }
  // One portable registration serves every GPU; read-only only where all
  // of them take it.
  plan.method = read_only ? PinMethod::kReadOnly : PinMethod::kWritable;
  plan.ordinal = gpus.devices.front().ordinal;
  return plan;
}

HostPinner::HostPinner(Options options)
    : options_(std::move(options)), plan_(ChoosePinPlan(options_.mode, options_.gpus)) {}

void HostPinner::Pin(absl::string_view model, absl::string_view what,
                     absl::Span<const SegmentPtr> segments) {
  if (plan_.method == PinMethod::kNone) {
    if (plan_.log_skips) {
      LogEvent(LogLevel::kWarning, "pin_skipped",
               {{"model", std::string(model)}, {"what", std::string(what)},
                {"reason", plan_.reason}});
    }
    return;
  }
  const CudaPluginApi* api = options_.api;
  if (api == nullptr) {
    absl::StatusOr<const CudaPluginApi*> loaded = LoadCudaPlugin();
    if (!loaded.ok()) {
      LogEvent(LogLevel::kWarning, "pin_skipped",
               {{"model", std::string(model)}, {"what", std::string(what)},
                {"reason", std::string(loaded.status().message())}});
      return;
    }
    api = *loaded;
  }
  const bool read_only = plan_.method == PinMethod::kReadOnly;
  const int ordinal = plan_.ordinal;
  const absl::Time start = absl::Now();
  uint64_t pinned = 0, count = 0, claimed = 0, not_pinnable = 0;
  absl::Status first_error;
  for (const SegmentPtr& seg : segments) {
    if (seg == nullptr || seg->size() == 0 || !seg->ClaimPinning()) continue;
    ++claimed;
    // Read-only: the sealed mapping as it is. Writable: the mapping the
    // seal kept writable (none: adopted, or sealed exclusively).
    const void* addr = read_only ? static_cast<const void*>(seg->data())
                                 : static_cast<const void*>(seg->registrable_mapping());
    if (addr == nullptr) {
      ++not_pinnable;
      continue;
    }
    const uint64_t size = seg->size();
    if (absl::Status s = api->pin(addr, size, read_only, ordinal); !s.ok()) {
      if (first_error.ok()) first_error = s;
      continue;
    }
    pinned_bytes_->fetch_add(size, std::memory_order_relaxed);
    seg->AddReleaseHook([unpin = api->unpin, addr, size, ordinal, counter = pinned_bytes_,
                         id = seg->id()]() {
      if (absl::Status s = unpin(addr, ordinal); !s.ok()) {
        LogEvent(LogLevel::kWarning, "unpin_failed",
                 {{"segment", absl::StrCat(id)}, {"bytes", absl::StrCat(size)},
                  {"error", s.ToString()}});
      }
      counter->fetch_sub(size, std::memory_order_relaxed);
    });
    pinned += size;
    ++count;
  }
  if (claimed == 0) return;  // every segment was pinned (or tried) for another holder
  std::vector<std::pair<std::string, std::string>> fields = {
      {"model", std::string(model)},
      {"what", std::string(what)},
      {"method", std::string(PinMethodName(plan_.method))},
      {"segments", absl::StrCat(count)},
      {"bytes", absl::StrCat(pinned)},
      {"not_pinnable", absl::StrCat(not_pinnable)},
      {"ms", absl::StrCat(absl::ToInt64Milliseconds(absl::Now() - start))},
      {"error", first_error.ok() ? std::string() : first_error.ToString()}};
  if (not_pinnable > 0) {
    fields.emplace_back("note",
                        "segments without a writable mapping (adopted at a hand-over, sealed "
                        "after a publisher wrote them in place, or a kernel before 5.10) "
                        "cannot be registered where read-only registration is unsupported");
  }
  LogEvent(first_error.ok() && not_pinnable == 0 ? LogLevel::kInfo : LogLevel::kWarning,
           "pinned", fields);
}

}  // namespace weightd
