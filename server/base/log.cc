#include "server/base/log.h"

#include <unistd.h>

#include <atomic>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace weightd {
namespace {

std::atomic<LogFormat> g_format{LogFormat::kText};
std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};

absl::string_view LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "info";
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          absl::StrAppend(&out, "\\u00", absl::BytesToHexString(std::string(1, c)));
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string Timestamp() {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
}

void Emit(std::string line) {
  line += '\n';
  (void)!::write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace

void SetLogFormat(LogFormat format) { g_format = format; }
void SetMinLogLevel(LogLevel level) { g_min_level = static_cast<int>(level); }
bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_min_level.load(); }

void LogEvent(LogLevel level, absl::string_view event,
              const std::vector<std::pair<std::string, std::string>>& fields) {
  if (!LogEnabled(level)) return;
  std::string line;
  if (g_format.load() == LogFormat::kJson) {
    line = absl::StrCat("{\"ts\":", JsonString(Timestamp()), ",\"level\":",
                        JsonString(LevelName(level)), ",\"event\":", JsonString(event));
    for (const auto& [k, v] : fields) absl::StrAppend(&line, ",", JsonString(k), ":", JsonString(v));
    line += "}";
  } else {
    line = absl::StrCat(Timestamp(), " ", LevelName(level), " ", event);
    for (const auto& [k, v] : fields) {
      bool quote = v.empty() || v.find_first_of(" \"=") != std::string::npos;
      absl::StrAppend(&line, " ", k, "=", quote ? JsonString(v) : v);
    }
  }
  Emit(std::move(line));
}

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  absl::string_view f(file);
  size_t slash = f.rfind('/');
  if (slash != absl::string_view::npos) f.remove_prefix(slash + 1);
  if (g_format.load() == LogFormat::kText) stream_ << f << ":" << line << ": ";
}

LogMessage::~LogMessage() {
  if (g_format.load() == LogFormat::kJson) {
    Emit(absl::StrCat("{\"ts\":", JsonString(Timestamp()), ",\"level\":",
                      JsonString(LevelName(level_)), ",\"msg\":", JsonString(stream_.str()),
                      "}"));
  } else {
    Emit(absl::StrCat(Timestamp(), " ", LevelName(level_), " ", stream_.str()));
  }
}

}  // namespace weightd
