# Link checks (docs/architecture.md "Link check"): which libraries a module target really drags
# into whatever links it.
#
# rc_write_link_closure(TARGET OUT_FILE) walks the target's link closure the way CMake's own
# link step does: the target's LINK_LIBRARIES, then every dependency's INTERFACE_LINK_LIBRARIES
# (a static library's PRIVATE dependencies are in there as $<LINK_ONLY:...>, because whatever
# links the archive must link them too), resolving ALIAS targets and the files of IMPORTED ones.
# It writes one line per item: `<item> [files...] <- <chain from the root>`, so a failing check
# says which edge brought the library in. It must run after every target exists, so it is
# deferred to the end of the top-level CMakeLists.txt.

function(rc_write_link_closure root out_file)
  set(queue "${root}")
  set(chains "${root}")
  set(seen "")
  set(lines "")
  while(queue)
    list(POP_FRONT queue item)
    list(POP_FRONT chains chain)
    if(item IN_LIST seen)
      continue()
    endif()
    list(APPEND seen "${item}")
    if(NOT TARGET "${item}")
      string(APPEND lines "${item} <- ${chain}\n")
      continue()
    endif()
    get_target_property(aliased "${item}" ALIASED_TARGET)
    if(aliased)
      set(item "${aliased}")
    endif()
    set(files "")
    get_target_property(imported "${item}" IMPORTED)
    if(imported)
      get_target_property(configs "${item}" IMPORTED_CONFIGURATIONS)
      set(props IMPORTED_LOCATION IMPORTED_LIBNAME)
      if(configs)
        foreach(c IN LISTS configs)
          string(TOUPPER "${c}" c)
          list(APPEND props IMPORTED_LOCATION_${c} IMPORTED_LIBNAME_${c})
        endforeach()
      endif()
      foreach(p IN LISTS props)
        get_target_property(f "${item}" ${p})
        if(f)
          list(APPEND files "${f}")
        endif()
      endforeach()
    endif()
    list(JOIN files " " files_text)
    string(APPEND lines "${item} ${files_text} <- ${chain}\n")
    if(item STREQUAL root)
      get_target_property(deps "${item}" LINK_LIBRARIES)
    else()
      get_target_property(deps "${item}" INTERFACE_LINK_LIBRARIES)
    endif()
    if(NOT deps)
      continue()
    endif()
    foreach(dep IN LISTS deps)
      # target_link_libraries() called from another directory brackets its items in ::@ markers.
      if(dep MATCHES "^::@")
        continue()
      endif()
      if(dep MATCHES "^\\$<LINK_ONLY:(.*)>$")
        set(dep "${CMAKE_MATCH_1}")
      endif()
      if(dep STREQUAL "")
        continue()
      endif()
      list(APPEND queue "${dep}")
      list(APPEND chains "${chain} -> ${dep}")
    endforeach()
  endwhile()
  file(WRITE "${out_file}" "${lines}")
endfunction()

# rc_add_link_check(LIBRARY) for LIBRARY in {directory, lifecycle, ...}: a CTest test
# `link_check_<LIBRARY>` (label unit) that fails when the rolloutcore::<LIBRARY> target links
# libucp/libucs (UCX), libnccl or libcudart (static or shared). It checks two things:
#  - the link closure above (catches static archives such as libcudart_static.a, which leave no
#    trace in the binary), and
#  - DT_NEEDED of `link_check_<LIBRARY>_bin`, a tiny program linked against that library alone
#    with --no-as-needed (Debian's GCC passes --as-needed, which would hide a shared library
#    that is on the link line but not yet called).
# rc_add_link_check(LIBRARY EXPECT_FORBIDDEN) makes the control: the same check must find a
# forbidden library (the test passes when the check fails), so the detector itself is tested.
function(rc_add_link_check lib)
  cmake_parse_arguments(ARG "EXPECT_FORBIDDEN" "" "" ${ARGN})
  set(bin link_check_${lib}_bin)
  set(closure ${PROJECT_BINARY_DIR}/link_check/${lib}.closure.txt)
  add_executable(${bin} ${PROJECT_SOURCE_DIR}/tests/link_check/link_check_main.cc)
  target_link_options(${bin} PRIVATE "LINKER:--no-as-needed")
  target_link_libraries(${bin} PRIVATE rolloutcore::${lib})
  # A deferred call's arguments are expanded when it runs, after this function's variables are
  # gone: EVAL substitutes them now.
  cmake_language(EVAL CODE
    "cmake_language(DEFER DIRECTORY [[${PROJECT_SOURCE_DIR}]] CALL rc_write_link_closure [[rc_${lib}]] [[${closure}]])")
  set(name link_check_${lib})
  if(ARG_EXPECT_FORBIDDEN)
    set(name link_check_control_${lib})
  endif()
  if(CMAKE_READELF)
    set(readelf ${CMAKE_READELF})
  else()
    find_program(readelf NAMES readelf REQUIRED)
  endif()
  add_test(NAME ${name}
    COMMAND ${CMAKE_COMMAND} -DLIBRARY=${lib} -DCLOSURE=${closure} -DBINARY=$<TARGET_FILE:${bin}>
            -DREADELF=${readelf} -P ${PROJECT_SOURCE_DIR}/tests/link_check/check_links.cmake)
  set_tests_properties(${name} PROPERTIES LABELS unit TIMEOUT 30)
  if(ARG_EXPECT_FORBIDDEN)
    set_tests_properties(${name} PROPERTIES WILL_FAIL TRUE)
  endif()
endfunction()
