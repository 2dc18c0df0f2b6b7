// Minimal logging to stderr: free-form lines (WD_LOG) and structured events
// (LogEvent), written as text or as one JSON object per line.
// Thread-safe: each line is written with one write(2).
#ifndef WEIGHTD_SERVER_BASE_LOG_H_
#define WEIGHTD_SERVER_BASE_LOG_H_

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace weightd {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kText, kJson };

void SetLogFormat(LogFormat format);
void SetMinLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// One structured event: `event` plus key/value fields, e.g.
// LogEvent(LogLevel::kInfo, "load", {{"model", "llama"}, {"bytes", "123"}}).
void LogEvent(LogLevel level, absl::string_view event,
              const std::vector<std::pair<std::string, std::string>>& fields);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace weightd

#define WD_LOG_DEBUG ::weightd::LogLevel::kDebug
#define WD_LOG_INFO ::weightd::LogLevel::kInfo
#define WD_LOG_WARNING ::weightd::LogLevel::kWarning
#define WD_LOG_ERROR ::weightd::LogLevel::kError
#define WD_LOG(severity)                              \
  if (!::weightd::LogEnabled(WD_LOG_##severity)) {    \
  } else                                              \
    ::weightd::LogMessage(WD_LOG_##severity, __FILE__, __LINE__).stream()

#endif  // WEIGHTD_SERVER_BASE_LOG_H_
