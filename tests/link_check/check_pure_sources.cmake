# Run by CTest (refit_core_purity): the sources of refit_core and the public refit headers it owns
# use no transport, no threads of their own and no clock (docs/architecture.md). FILES is the
# ';'-separated list to scan (its '|' stands for ';' on the command line).
cmake_minimum_required(VERSION 3.25)  # policies of a script run with -P (IN_LIST)
string(REPLACE "|" ";" files "${FILES}")
set(rules
  "#include [<\"]rolloutcore/transport/" "a transport header"
  "#include <thread>" "<thread>"
  "#include <chrono>" "<chrono>"
  "steady_clock|system_clock|high_resolution_clock" "a std::chrono clock"
  "std::j?thread" "std::thread"
  "rolloutcore/base/clock\\.h" "rc::Clock (take it from the caller, do not include it in a .cc)")
set(problems "")
list(LENGTH files n)
if(n LESS 10)
  message(FATAL_ERROR "only ${n} files to scan: the list is broken")
endif()
foreach(f IN LISTS files)
  if(NOT EXISTS "${f}")
    message(FATAL_ERROR "${f} does not exist")
  endif()
  # Read the lines by hand: file(STRINGS) lists break at unbalanced '[' (CMake list syntax).
  file(READ "${f}" content)
  string(REPLACE ";" "," content "${content}")
  string(REPLACE "[" "{" content "${content}")
  string(REPLACE "]" "}" content "${content}")
  string(REPLACE "\n" ";" lines "${content}")
  list(LENGTH rules nr)
  set(i 0)
  while(i LESS nr)
    list(GET rules ${i} re)
    math(EXPR j "${i} + 1")
    list(GET rules ${j} what)
    math(EXPR i "${i} + 2")
    # A header may name rc::Clock in an interface (fleet.h takes the caller's clock).
    if(what MATCHES "^rc::Clock" AND f MATCHES "\\.h$")
      continue()
    endif()
    if(NOT content MATCHES "${re}")
      continue()
    endif()
    set(lineno 0)
    foreach(line IN LISTS lines)
      math(EXPR lineno "${lineno} + 1")
      if(line MATCHES "${re}")
        string(APPEND problems "  ${f}:${lineno}: ${what}: ${line}\n")
      endif()
    endforeach()
  endwhile()
endforeach()
if(problems)
  message(FATAL_ERROR "refit_core must use no transport, no threads of its own and no clock:\n${problems}")
endif()
message(STATUS "refit_core: ${n} files, no transport, thread or clock")
