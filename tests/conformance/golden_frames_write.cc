// Rewrites golden_frames.txt from common/data_protocol.h's structs:
//   golden_frames_write tests/conformance/golden_frames.txt
// Only when the protocol changes on purpose: the file is what both clients
// are checked against.
#include <cstdio>
#include <fstream>

#include "tests/conformance/golden_frames.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: golden_frames_write FILE\n");
    return 2;
  }
  std::ofstream(argv[1]) << weightd::golden::Render(weightd::golden::Frames());
  return 0;
}
