# Finds NCCL (header nccl.h, library libnccl.so) for the nccl transport and defines the imported
# target rc::nccl. Looks in NCCL_ROOT (CMake variable or environment), then next to the CUDA
# toolkit, then the system paths.
find_path(RC_NCCL_INCLUDE_DIR nccl.h
  HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT}
  PATH_SUFFIXES include)
find_library(RC_NCCL_LIBRARY NAMES nccl
  HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}
  PATH_SUFFIXES lib lib64)
if(NOT RC_NCCL_INCLUDE_DIR OR NOT RC_NCCL_LIBRARY)
  message(FATAL_ERROR "ROLLOUTCORE_WITH_NCCL=ON but NCCL was not found (nccl.h: '${RC_NCCL_INCLUDE_DIR}', "
                      "libnccl: '${RC_NCCL_LIBRARY}'); set NCCL_ROOT to the folder holding include/nccl.h")
endif()
file(STRINGS ${RC_NCCL_INCLUDE_DIR}/nccl.h RC_NCCL_VERSION_LINES REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
message(STATUS "NCCL: ${RC_NCCL_LIBRARY} (${RC_NCCL_VERSION_LINES})")
add_library(rc::nccl UNKNOWN IMPORTED)
set_target_properties(rc::nccl PROPERTIES
  IMPORTED_LOCATION ${RC_NCCL_LIBRARY}
  INTERFACE_INCLUDE_DIRECTORIES ${RC_NCCL_INCLUDE_DIR})
