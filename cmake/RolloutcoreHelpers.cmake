# Helpers that give every module the same shape: one static target, one gtest binary,
# one set of warnings. Sources are always listed explicitly (no file(GLOB)).

# GCC 12 at -O3 (the release and cuda presets) reports -Wrestrict inside std::string's own
# operator+ where no overlap exists (GCC bug 105651): shown, not fatal, in that configuration only.
set(RC_WARNINGS -Wall -Wextra -Wpedantic -Wnon-virtual-dtor
  $<$<CXX_COMPILER_ID:GNU>:-Wshadow=local>
  $<$<AND:$<CXX_COMPILER_ID:GNU>,$<CONFIG:Release>>:-Wno-error=restrict>
  $<$<CXX_COMPILER_ID:Clang>:-Wshadow-uncaptured-local>
  $<$<CXX_COMPILER_ID:Clang>:-Wthread-safety>)
if(ROLLOUTCORE_WERROR)
  list(APPEND RC_WARNINGS -Werror)
endif()
# Flags for CUDA sources (.cu) of the GPU modules: host warnings through -Xcompiler, and constexpr
# host functions (rc::Mix64, the digest term) callable from device code so GPU and CPU share them.
set(RC_CUDA_FLAGS
  "$<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr;-Xcompiler=-Wall,-Wextra;-lineinfo>")

if(ROLLOUTCORE_SANITIZER STREQUAL "asan")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(ROLLOUTCORE_SANITIZER STREQUAL "tsan")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT ROLLOUTCORE_SANITIZER STREQUAL "")
  message(FATAL_ERROR "ROLLOUTCORE_SANITIZER must be '', 'asan' or 'tsan', got '${ROLLOUTCORE_SANITIZER}'")
endif()

# The asan tree also builds the libFuzzer targets (CI: one clang sanitizer tree for the unit and
# fault tests and the fuzzers): coverage instrumentation (-fsanitize=fuzzer-no-link) in every module
# a fuzzer calls into (the fuzzers of src/formats, directory, lifecycle, engine, refit), not in the
# tests or the modules no fuzzer reaches (it costs a fifth of their compile time).
set(RC_FUZZED_MODULES base formats directory lifecycle receiver engine refit_core refit_exec
  transport_api transport_local transport)

# Build speed where run speed does not matter. Test sources, and the control-plane modules (HTTP,
# JSON, journals: I/O-bound code), compile at RC_FAST_BUILD_OPT: -O0 in the sanitizer trees (the
# other modules keep -O1), -O1 in the dev tree (RelWithDebInfo; the others keep -O2), nothing
# changed in the release tree. The modules with the hot loops (kernels, digests, copies, the
# transports, the synthetic trainer's tensors) keep the tree's level. Test sources are half of the
# compile time (GoogleTest, gmock and nlohmann-json templates) and what they run is library code;
# docs/testing.md "What CI time goes to" has the measurements. The flag comes after
# CMAKE_CXX_FLAGS_<CONFIG> on the command line, so it wins.
set(RC_FAST_BUILD_MODULES net directory lifecycle controller adapters)
if(NOT ROLLOUTCORE_SANITIZER STREQUAL "")
  set(RC_FAST_BUILD_OPT -O0)
elseif(CMAKE_BUILD_TYPE STREQUAL "RelWithDebInfo")
  set(RC_FAST_BUILD_OPT -O1)
else()
  set(RC_FAST_BUILD_OPT "")
endif()

# rc_add_module(NAME SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# Makes static library rc_<NAME> with alias rolloutcore::<NAME>.
function(rc_add_module name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(rc_${name} STATIC ${ARG_SOURCES})
  add_library(rolloutcore::${name} ALIAS rc_${name})
  target_include_directories(rc_${name}
    PUBLIC ${PROJECT_SOURCE_DIR}/include
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(rc_${name} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${RC_WARNINGS}>" ${RC_CUDA_FLAGS})
  if(name IN_LIST RC_FAST_BUILD_MODULES AND RC_FAST_BUILD_OPT)
    target_compile_options(rc_${name} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${RC_FAST_BUILD_OPT}>")
  endif()
  if(ROLLOUTCORE_BUILD_FUZZERS AND name IN_LIST RC_FUZZED_MODULES)
    target_compile_options(rc_${name} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>")
  endif()
  target_link_libraries(rc_${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
endfunction()

# rc_add_test(NAME LABEL label SOURCES ... DEPS ... [TIMEOUT s])
# Makes gtest binary NAME, registered with gtest_discover_tests under CTest label LABEL.
function(rc_add_test name)
  cmake_parse_arguments(ARG "" "LABEL;TIMEOUT" "SOURCES;DEPS" ${ARGN})
  if(NOT ROLLOUTCORE_BUILD_TESTS)
    return()
  endif()
  if(NOT ARG_LABEL)
    set(ARG_LABEL unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  set_property(GLOBAL APPEND PROPERTY RC_TESTS_LABEL_${ARG_LABEL} ${name})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  target_compile_options(${name} PRIVATE ${RC_WARNINGS} ${RC_FAST_BUILD_OPT})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  gtest_discover_tests(${name}
    PROPERTIES LABELS ${ARG_LABEL} TIMEOUT ${ARG_TIMEOUT}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
    DISCOVERY_TIMEOUT 60)
endfunction()

# rc_add_benchmark(NAME SOURCES ... DEPS ...): a Google Benchmark binary (not run by ctest).
function(rc_add_benchmark name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  if(NOT ROLLOUTCORE_BUILD_BENCHMARKS)
    return()
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(${name} PRIVATE ${RC_WARNINGS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} benchmark::benchmark)
endfunction()

# rc_add_fuzzer(NAME SOURCES ... DEPS ...): a libFuzzer target, built only with clang and
# ROLLOUTCORE_BUILD_FUZZERS=ON (preset 'fuzz').
function(rc_add_fuzzer name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  if(NOT ROLLOUTCORE_BUILD_FUZZERS)
    return()
  endif()
  add_executable(${name} ${ARG_SOURCES})
  set_property(GLOBAL APPEND PROPERTY RC_FUZZERS ${name})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
endfunction()

# Build targets per CTest label: `cmake --build <tree> --target rc_tests_unit rc_tests_fault` builds
# only the test binaries of those labels (and what they depend on, e.g. a peer program added with
# add_dependencies), not the e2e tests, the app or the benchmarks. The sanitizer CI steps use it
# (scripts/test.sh asan|tsan). Defined once every directory has registered its tests.
function(rc_define_label_targets)
  foreach(label unit fault e2e gpu bench)
    get_property(tests GLOBAL PROPERTY RC_TESTS_LABEL_${label})
    if(NOT TARGET rc_tests_${label})
      add_custom_target(rc_tests_${label})
    endif()
    if(tests)
      add_dependencies(rc_tests_${label} ${tests})
    endif()
  endforeach()
  # rc_fuzzers: every libFuzzer target (empty unless ROLLOUTCORE_BUILD_FUZZERS).
  get_property(fuzzers GLOBAL PROPERTY RC_FUZZERS)
  add_custom_target(rc_fuzzers)
  if(fuzzers)
    add_dependencies(rc_fuzzers ${fuzzers})
  endif()
endfunction()
if(NOT RC_LABEL_TARGETS_DEFERRED)
  set(RC_LABEL_TARGETS_DEFERRED ON)
  cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL rc_define_label_targets)
endif()
