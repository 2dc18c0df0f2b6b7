// PLACEHOLDER
#include "common/shard.h"
