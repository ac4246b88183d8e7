# Run by CTest (link_check_<LIBRARY>): fails when rolloutcore::<LIBRARY> links UCX (libucp,
# libucs), NCCL (libnccl) or the CUDA runtime (libcudart, static or shared).
# Inputs: LIBRARY, CLOSURE (written at configure time by rc_write_link_closure), BINARY (a program
# linked against the library alone, with --no-as-needed), READELF.
cmake_minimum_required(VERSION 3.25)  # policies of a script run with -P (IN_LIST)
set(forbidden "(lib(ucp|ucs|nccl|cudart)[._]|-l(ucp|ucs|nccl|cudart)( |$)|PkgConfig::UCX|rc::nccl|CUDA::cudart|rc_transport_(ucx|nccl|cuda_ipc) )")

if(NOT EXISTS "${CLOSURE}")
  message(FATAL_ERROR "link check of ${LIBRARY}: closure file ${CLOSURE} is missing (re-run cmake)")
endif()
if(NOT EXISTS "${BINARY}")
  message(FATAL_ERROR "link check of ${LIBRARY}: binary ${BINARY} is missing (build it first)")
endif()

set(problems "")
# 1. The link closure.
file(STRINGS "${CLOSURE}" closure_lines)
list(LENGTH closure_lines n_closure)
set(saw_base FALSE)
foreach(line IN LISTS closure_lines)
  if(line MATCHES "^rc_base ")
    set(saw_base TRUE)
  endif()
  # Match the item and its files, not the chain that led to it (the chain names its parents).
  string(REGEX REPLACE " <- .*$" "" item "${line}")
  if("${item} " MATCHES "${forbidden}")
    string(APPEND problems "  link closure: ${line}\n")
  endif()
endforeach()
# A walk that found nothing would pass vacuously: every module links rolloutcore::base.
if(NOT saw_base)
  message(FATAL_ERROR "link check of ${LIBRARY}: the closure (${n_closure} items) does not contain rc_base; the walk is broken")
endif()

# 2. What the linker recorded in a real binary.
execute_process(COMMAND "${READELF}" -d "${BINARY}" OUTPUT_VARIABLE dyn RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "link check of ${LIBRARY}: '${READELF} -d ${BINARY}' failed (${rc})")
endif()
string(REGEX MATCHALL "Shared library: \\[[^]]+\\]" needed "${dyn}")
if(NOT needed)
  message(FATAL_ERROR "link check of ${LIBRARY}: ${BINARY} has no DT_NEEDED entries; readelf output:\n${dyn}")
endif()
foreach(n IN LISTS needed)
  if("${n} " MATCHES "${forbidden}")
    string(APPEND problems "  DT_NEEDED of ${BINARY}: ${n}\n")
  endif()
endforeach()

if(problems)
  message(FATAL_ERROR "rolloutcore::${LIBRARY} links UCX, NCCL or the CUDA runtime (docs/architecture.md: "
                      "only transport backends and the cuda module may):\n${problems}")
endif()
list(LENGTH needed n_needed)
message(STATUS "rolloutcore::${LIBRARY}: ${n_closure} link items, ${n_needed} DT_NEEDED entries, none of them UCX, NCCL or CUDA")
