# Third-party dependencies, all from Debian bookworm packages
# (scripts/test.sh installs them).
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(GTest REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(RE2 REQUIRED IMPORTED_TARGET re2)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
# Remote checkpoint sources (server/source only): libcurl4-openssl-dev.
pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)
find_package(nlohmann_json 3 REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)

find_program(WEIGHTD_PROTOC protoc REQUIRED)
find_program(WEIGHTD_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
find_program(WEIGHTD_GRPC_PYTHON_PLUGIN grpc_python_plugin)
find_program(WEIGHTD_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
