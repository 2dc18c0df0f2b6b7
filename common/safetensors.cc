// PLACEHOLDER
#include "common/safetensors.h"
