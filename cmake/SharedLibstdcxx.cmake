# Links libstdc++ as PyTorch does: the shared runtime, libstdc++.so.6.
#
# A GCC whose own library folder holds the static archive libstdc++.a but no
# libstdc++.so beside it (a GCC installed without its shared runtime, as
# /opt/gcc on one GPU image) links the archive into a shared library: a second
# libstdc++ inside the library, beside the libstdc++.so.6 the process has
# loaded for PyTorch. The two copies number their locale facets apart, and
# writing a number into a stream from the library then read a facet that was
# not there (a segfault building any error message that holds a device index).
#
# The linker searches the folders given with -L before the compiler's own, one
# folder at a time, a shared library before an archive. Where the archive
# would be found first, a folder holding a libstdc++.so link to the shared
# runtime is given with -L, for every target after this call.
function(mgpu_use_shared_libstdcxx)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    return()
  endif()
  foreach(name libstdc++.so libstdc++.a libstdc++.so.6)
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=${name}
      OUTPUT_VARIABLE found OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0 OR NOT IS_ABSOLUTE "${found}" OR NOT EXISTS "${found}")
      set(found "")
    endif()
    set("path_${name}" "${found}")
  endforeach()
  set(shared "${path_libstdc++.so}")
  set(archive "${path_libstdc++.a}")
  if(archive STREQUAL "")
    return()  # nothing static to link by mistake
  endif()
  if(NOT shared STREQUAL "")
    get_filename_component(shared_dir "${shared}" DIRECTORY)
    get_filename_component(archive_dir "${archive}" DIRECTORY)
    get_filename_component(shared_dir "${shared_dir}" REALPATH)
    get_filename_component(archive_dir "${archive_dir}" REALPATH)
    if(shared_dir STREQUAL archive_dir)
      return()  # the shared library is found first in the archive's folder
    endif()
  endif()
  # The runtime: the compiler's own if it names one, else the system's.
  set(runtime "${path_libstdc++.so.6}")
  if(runtime STREQUAL "")
    find_library(MGPU_LIBSTDCXX_RUNTIME NAMES libstdc++.so.6
      PATHS /lib/${CMAKE_LIBRARY_ARCHITECTURE} /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE} /usr/lib64 /lib64 /usr/lib /lib)
    set(runtime "${MGPU_LIBSTDCXX_RUNTIME}")
  endif()
  if(runtime STREQUAL "" OR runtime MATCHES "NOTFOUND")
    message(FATAL_ERROR "torch_mgpu: ${CMAKE_CXX_COMPILER} would link the static ${archive} "
      "into the library (a second libstdc++ beside the libstdc++.so.6 PyTorch loads) and no "
      "libstdc++.so.6 was found to link instead: set CMAKE_CXX_COMPILER to a GCC with its shared "
      "runtime, or MGPU_LIBSTDCXX_RUNTIME to a libstdc++.so.6")
  endif()
  set(dir "${CMAKE_BINARY_DIR}/shared-libstdcxx")
  file(MAKE_DIRECTORY "${dir}")
  file(REMOVE "${dir}/libstdc++.so")
  file(CREATE_LINK "${runtime}" "${dir}/libstdc++.so" SYMBOLIC)
  add_link_options("-L${dir}")
  message(STATUS "torch_mgpu: libstdc++ linked shared from ${runtime} "
    "(${CMAKE_CXX_COMPILER} would have linked ${archive})")
endfunction()
