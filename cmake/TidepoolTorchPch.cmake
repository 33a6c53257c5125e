# One precompiled <torch/torch.h> for the targets built on LibTorch.
#
# Parsing torch/torch.h is most of the compile time of every file that includes it, and
# CI compiles sixteen of them in the normal build and thirteen again under ASan+UBSan. One
# precompiled header, built once per build tree and reused by every such target, makes
# that parse a load: optimizers/apollo.cpp took 24 s with it against 49 s without, side
# by side on the 2-core CI machine (2026-12-02, with another build running). Loading it
# costs several seconds, though: optimizers/linalg/gram.cpp, which includes only ATen,
# took 25 s with it against 16 s without. So only the files that include torch/torch.h
# use it (tidepool_use_torch_pch's ONLY).
#
# GCC uses a precompiled header only when it was built with the same code-generation
# flags (-fPIC/-fpie, sanitizers, -std) and every macro defined when it was built is
# defined the same way where it is used; macros defined only at the use are fine. Hence
# the PCH target has no definitions of its own beyond LibTorch's, and is compiled -fPIC
# (the top-level CMakeLists makes every target position independent); executables, which
# that gives -fPIE, get -fPIC added by tidepool_use_torch_pch. -Winvalid-pch turns a rejected PCH
# (which GCC would silently replace by the header's text: correct, only slow) into a
# warning. CMAKE_DISABLE_PRECOMPILE_HEADERS=ON turns it all off, e.g. to check that each
# file includes what it uses.

# tidepool_torch_pch_target(): the target that owns the precompiled header.
function(tidepool_torch_pch_target)
  if(TARGET tidepool_torch_pch)
    return()
  endif()
  add_library(tidepool_torch_pch OBJECT "${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp")
  target_link_libraries(tidepool_torch_pch PRIVATE ${TORCH_LIBRARIES})
  target_precompile_headers(tidepool_torch_pch PRIVATE
    "$<$<COMPILE_LANGUAGE:CXX>:<torch/torch.h$<ANGLE-R>>")
endfunction()

# tidepool_use_torch_pch(<target>... [ONLY <source>...]): the targets' C++ sources start
# from the precompiled <torch/torch.h>; with ONLY, just those sources (paths relative to
# the calling directory). Loading the header costs several seconds, more than a file that
# includes only ATen or c10 parses, so only files that include torch/torch.h (directly or
# through a header such as optimizers/apollo.h) should use it.
function(tidepool_use_torch_pch)
  cmake_parse_arguments(PARSE_ARGV 0 _pch "" "" "ONLY")
  tidepool_torch_pch_target()
  set(_only)
  foreach(src IN LISTS _pch_ONLY)
    cmake_path(ABSOLUTE_PATH src BASE_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}" NORMALIZE
               OUTPUT_VARIABLE _absolute)
    list(APPEND _only "${_absolute}")
  endforeach()
  foreach(target IN LISTS _pch_UNPARSED_ARGUMENTS)
    target_precompile_headers(${target} REUSE_FROM tidepool_torch_pch)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-Winvalid-pch>")
    get_target_property(_type ${target} TYPE)
    if(_type STREQUAL "EXECUTABLE")
      # The header is compiled -fPIC (for the shared libraries); an executable's -fPIE
      # would make GCC reject it. The last of the two flags wins, and -fPIC code links
      # into a position-independent executable all the same.
      target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-fPIC>")
    endif()
    get_target_property(_sources ${target} SOURCES)
    get_target_property(_source_dir ${target} SOURCE_DIR)
    foreach(src IN LISTS _sources)
      cmake_path(ABSOLUTE_PATH src BASE_DIRECTORY "${_source_dir}" NORMALIZE
                 OUTPUT_VARIABLE _absolute)
      # nvcc takes no GCC precompiled header (the kernels include no LibTorch anyway).
      if(src MATCHES "\\.cu$" OR (_pch_ONLY AND NOT _absolute IN_LIST _only))
        set_source_files_properties(${src} TARGET_DIRECTORY ${target}
                                    PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
      endif()
    endforeach()
  endforeach()
endfunction()
