// What profile.cc, profile_parse.cc and profile_map.cc share and nothing
// else uses: how user text is quoted in messages.
#ifndef WEIGHTD_SERVER_PROFILE_PROFILE_INTERNAL_H_
#define WEIGHTD_SERVER_PROFILE_PROFILE_INTERNAL_H_

#include <string>

#include "absl/strings/string_view.h"

namespace weightd::profile_internal {

// Names and patterns come from users. Short printable text is quoted as is
// (patterns read best unescaped); anything long or with control characters
// is capped and escaped.
std::string Quote(absl::string_view text);

}  // namespace weightd::profile_internal

#endif  // WEIGHTD_SERVER_PROFILE_PROFILE_INTERNAL_H_
