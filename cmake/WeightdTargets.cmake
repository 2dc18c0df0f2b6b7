# Warning and sanitizer flags for weightd's own targets (not generated code).
set(WEIGHTD_WARNINGS -Wall -Wextra -Werror -Wno-unused-parameter
    -Wno-missing-field-initializers)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  list(APPEND WEIGHTD_WARNINGS -Wthread-safety)
elseif(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC 12 at -O3 reports -Wrestrict false positives inside libstdc++'s
  # std::string (GCC bug 105329); they would fail --release builds.
  list(APPEND WEIGHTD_WARNINGS -Wno-restrict)
endif()

if(WEIGHTD_SANITIZE)
  add_compile_options(-fsanitize=${WEIGHTD_SANITIZE} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${WEIGHTD_SANITIZE})
endif()

# No contraction of a multiply and an add into one FMA, in every target of
# ours: GCC contracts by default in C++ (-ffp-contract=fast, ISO mode or
# not) wherever the target ISA has FMA (-march=haswell and later,
# -march=native, aarch64), and then the element functions that the CPU and
# the GPU share (server/kernels/cast_elements.h, merge_elements.h) and the LoRA
# merges round differently from PyTorch and from the GPU. Explicit FMAs
# (std::fma, _mm256_fmadd_ps) are unaffected. fp_contract_test checks it.
set(WEIGHTD_FP_FLAGS -ffp-contract=off)

function(weightd_target_defaults target)
  target_compile_options(${target} PRIVATE ${WEIGHTD_WARNINGS} ${WEIGHTD_FP_FLAGS})
  target_include_directories(${target} PUBLIC ${CMAKE_SOURCE_DIR})
endfunction()

# weightd_unit_test(name SOURCES... LIBS...)
function(weightd_unit_test name)
  cmake_parse_arguments(T "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  weightd_target_defaults(${name})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                        ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  set(labels unit ${T_LABELS})
  set_tests_properties(${name} PROPERTIES LABELS "${labels}" TIMEOUT 300)
endfunction()
