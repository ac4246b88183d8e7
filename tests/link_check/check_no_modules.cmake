# Run by CTest (receiver_no_engine and its control): fails when the link closure of
# rolloutcore::<LIBRARY> (written at configure time by rc_write_link_closure) contains one of the
# module targets named in MODULES ("engine|adapters": rc_engine, rc_adapters), printing the chain
# of edges that brought it in. Inputs: LIBRARY, CLOSURE, MODULES.
cmake_minimum_required(VERSION 3.25)
if(NOT EXISTS "${CLOSURE}")
  message(FATAL_ERROR "link check of ${LIBRARY}: closure file ${CLOSURE} is missing (re-run cmake)")
endif()
file(STRINGS "${CLOSURE}" closure_lines)
list(LENGTH closure_lines n_closure)
set(saw_base FALSE)
set(problems "")
foreach(line IN LISTS closure_lines)
  if(line MATCHES "^rc_base ")
    set(saw_base TRUE)
  endif()
  # The item itself (with ALIAS targets resolved), not the chain that led to it.
  string(REGEX REPLACE " .*$" "" item "${line}")
  if(item MATCHES "^rc_(${MODULES})$")
    string(APPEND problems "  ${line}\n")
  endif()
endforeach()
# A walk that found nothing would pass vacuously: every module links rolloutcore::base.
if(NOT saw_base)
  message(FATAL_ERROR "link check of ${LIBRARY}: the closure (${n_closure} items) does not contain rc_base; the walk is broken")
endif()
if(problems)
  message(FATAL_ERROR "rolloutcore::${LIBRARY} links a module above it (${MODULES}; docs/architecture.md):\n${problems}")
endif()
message(STATUS "rolloutcore::${LIBRARY}: ${n_closure} link items, none of them the modules ${MODULES}")
