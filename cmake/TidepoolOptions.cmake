# Compiler warnings, sanitizers, CUDA detection and LibTorch discovery, in one place.

add_compile_options(
  "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wshadow;-Wnon-virtual-dtor;-Wno-unused-parameter>"
  # The test fakes (C) and the kernels' host code (CUDA) too (review finding: unwarned).
  "$<$<COMPILE_LANGUAGE:C>:-Wall;-Wextra;-Wshadow;-Wno-unused-parameter>"
  "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wshadow,-Wno-unused-parameter>")

# Our shared libraries never re-export what they link from static archives. Some
# toolchains (the H200 image's) link libstdc++ and librt statically here; exported, those
# copies of __cxa_throw & co. get interposed by the process's libstdc++.so once torch is
# loaded, and the first C++ exception thrown inside libtidepool crashed the process.
set(CMAKE_SHARED_LINKER_FLAGS "${CMAKE_SHARED_LINKER_FLAGS} -Wl,--exclude-libs,ALL")

if(TIDEPOOL_SANITIZE)
  message(STATUS "tidepool: sanitizers ${TIDEPOOL_SANITIZE}")
  set(tidepool_sanitizer_flags
      "-fsanitize=${TIDEPOOL_SANITIZE};-fno-omit-frame-pointer;-fno-sanitize-recover=all")
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${tidepool_sanitizer_flags}>")
  add_link_options("-fsanitize=${TIDEPOOL_SANITIZE}")
endif()

# --- CUDA -----------------------------------------------------------------------
# Without a GPU to ask: every architecture nvcc 13 builds for from Turing on, with PTX of
# the newest for later cards.
set(TIDEPOOL_DEFAULT_CUDA_ARCHITECTURES "75-real;80-real;86-real;89-real;90-real;100-real;120")
set(TIDEPOOL_HAVE_CUDA OFF)
if(NOT TIDEPOOL_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # The GPUs of this machine when it has any (nvidia-smi), so that the fused kernels have
      # an image for the card the build will run on; without one (a CI machine, a wheel
      # built for others), every architecture nvcc 13 builds for from Turing on, with PTX
      # of the newest for later cards. -DCMAKE_CUDA_ARCHITECTURES=... overrides both.
      set(_tidepool_archs "")
      find_program(_tidepool_nvidia_smi nvidia-smi)
      if(_tidepool_nvidia_smi)
        execute_process(COMMAND ${_tidepool_nvidia_smi} --query-gpu=compute_cap
                                --format=csv,noheader
                        OUTPUT_VARIABLE _tidepool_caps RESULT_VARIABLE _tidepool_smi_rc
                        ERROR_QUIET)
        if(_tidepool_smi_rc EQUAL 0)
          string(REPLACE "." "" _tidepool_caps "${_tidepool_caps}")
          string(REGEX MATCHALL "[0-9]+" _tidepool_archs "${_tidepool_caps}")
          list(REMOVE_DUPLICATES _tidepool_archs)
        endif()
      endif()
      if(_tidepool_archs)
        set(CMAKE_CUDA_ARCHITECTURES "${_tidepool_archs}")
      else()
        set(CMAKE_CUDA_ARCHITECTURES "${TIDEPOOL_DEFAULT_CUDA_ARCHITECTURES}")
      endif()
      message(STATUS "tidepool: CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")
    endif()
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc 13's C++20 flag; the kernels need only C++17.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(TIDEPOOL_HAVE_CUDA ON)
  elseif(TIDEPOOL_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TIDEPOOL_CUDA=ON but no CUDA compiler was found (is nvcc on PATH?)")
  endif()
endif()
message(STATUS "tidepool: CUDA backend ${TIDEPOOL_HAVE_CUDA}")

# --- LibTorch -------------------------------------------------------------------
# Torch's CMake ignores CMAKE_CUDA_ARCHITECTURES (it sets it OFF, with a warning) and
# compiles every CUDA file of the project for TORCH_CUDA_ARCH_LIST instead: left at one
# architecture, the fused kernels had an image for that one card alone ("no kernel image
# is available" on any other; review finding). So the list chosen above is handed to it in
# its own form ("75-real" -> "7.5", a plain "120" -> "12.0+PTX", "90a" -> "9.0a",
# "native" -> "Auto": Torch's own detection; "all" and "all-major" -> the list this file
# picks without a GPU, as Torch's "All" names cards nvcc 13 no longer builds for), unless
# the caller set TORCH_CUDA_ARCH_LIST (in the environment, or on the command line). A
# value it cannot hand over stops the configure. Without CUDA, one architecture keeps
# Torch's CMake from running its GPU-detection program.
function(tidepool_torch_arch_list _out)
  set(_list "")
  set(_archs "${CMAKE_CUDA_ARCHITECTURES}")
  if(_archs STREQUAL "all" OR _archs STREQUAL "all-major")
    set(_archs "${TIDEPOOL_DEFAULT_CUDA_ARCHITECTURES}")
  endif()
  if(TIDEPOOL_HAVE_CUDA)
    foreach(_arch IN LISTS _archs)
      if(_arch STREQUAL "native")
        list(APPEND _list "Auto")
      elseif(_arch MATCHES "^([0-9]+)([0-9])([af]?)(-real|-virtual)?$")
        set(_torch_arch "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
        if(NOT CMAKE_MATCH_4 STREQUAL "-real")
          string(APPEND _torch_arch "+PTX")  # Torch has no PTX-only form
        endif()
        list(APPEND _list "${_torch_arch}")
      else()
        message(FATAL_ERROR "tidepool: cannot hand CUDA architecture '${_arch}' (of "
                            "CMAKE_CUDA_ARCHITECTURES) to Torch's CMake; give "
                            "TORCH_CUDA_ARCH_LIST instead (e.g. \"8.0;9.0+PTX\")")
      endif()
    endforeach()
  endif()
  if(NOT _list)
    set(_list "9.0")
  endif()
  set(${_out} "${_list}" PARENT_SCOPE)
endfunction()

# tidepool_find_torch(<found> REQUIRED|OPTIONAL): LibTorch from the torch that
# ${Python3_EXECUTABLE} imports (torch.utils.cmake_prefix_path), else one installed in the
# system prefixes (Debian's libtorch-dev). Sets <found> to TRUE or FALSE; REQUIRED makes
# finding neither a fatal error. A macro: find_package(Torch)
# must set TORCH_LIBRARIES in the caller's scope.
macro(tidepool_find_torch _found _mode)
  find_package(Python3 COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c "import torch; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE TIDEPOOL_TORCH_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _tidepool_torch_rc ERROR_QUIET)
  set(${_found} FALSE)
  if(_tidepool_torch_rc EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH "${TIDEPOOL_TORCH_PREFIX}")
    # The architectures chosen above, in Torch's form (tidepool_torch_arch_list), unless
    # the caller gave its own: in the environment, or on the command line (a cache entry
    # this file did not write; one it wrote is written again, as the choice may change).
    get_property(_tidepool_arch_help CACHE TORCH_CUDA_ARCH_LIST PROPERTY HELPSTRING)
    set(_tidepool_arch_ours "tidepool: CMAKE_CUDA_ARCHITECTURES in Torch's form")
    set(_tidepool_arch_cached_ours FALSE)
    if(_tidepool_arch_help STREQUAL _tidepool_arch_ours OR
       _tidepool_arch_help STREQUAL "CUDA archs for Torch's CMake")
      set(_tidepool_arch_cached_ours TRUE)
    endif()
    if(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND _tidepool_arch_cached_ours)
      # Torch reads the environment only while the variable is undefined: a list this
      # file cached at an earlier configure would hide the one given now.
      unset(TORCH_CUDA_ARCH_LIST CACHE)
    endif()
    if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND
       (NOT DEFINED CACHE{TORCH_CUDA_ARCH_LIST} OR _tidepool_arch_cached_ours))
      tidepool_torch_arch_list(_tidepool_torch_archs)
      set(TORCH_CUDA_ARCH_LIST "${_tidepool_torch_archs}" CACHE STRING "${_tidepool_arch_ours}"
          FORCE)
      message(STATUS "tidepool: TORCH_CUDA_ARCH_LIST ${TORCH_CUDA_ARCH_LIST}")
    endif()
    # The cache keeps the LibTorch an earlier configure found, and find_package looks no
    # further: after Debian's fallback, or with another PYTHON, that is not the torch this
    # interpreter imports, whose Python tests then run against another build. So a
    # LibTorch outside this torch's prefix that find_package cached is forgotten and looked
    # for again; one given on the command line (-DTorch_DIR=...) is the caller's choice.
    foreach(_tidepool_torch_dir Torch_DIR Caffe2_DIR)
      get_property(_tidepool_dir_help CACHE ${_tidepool_torch_dir} PROPERTY HELPSTRING)
      if(DEFINED CACHE{${_tidepool_torch_dir}} AND
         NOT _tidepool_dir_help MATCHES "specified on the command line")
        string(FIND "${${_tidepool_torch_dir}}" "${TIDEPOOL_TORCH_PREFIX}" _tidepool_at)
        if(NOT _tidepool_at EQUAL 0)
          message(STATUS "tidepool: ${_tidepool_torch_dir} (${${_tidepool_torch_dir}}) is not "
                         "the torch ${Python3_EXECUTABLE} imports; looking again")
          unset(${_tidepool_torch_dir} CACHE)
        endif()
      endif()
    endforeach()
    find_package(Torch REQUIRED)
    set(${_found} TRUE)
  else()
    # scripts/setup falls back to Debian's libtorch-dev when the PyPI wheel cannot be
    # installed: its CMake files lie in the system prefixes, which a plain search covers.
    find_package(Torch CONFIG QUIET)
    if(Torch_FOUND)
      message(STATUS "tidepool: ${Python3_EXECUTABLE} cannot import torch; using the "
                     "LibTorch of the system prefixes (${Torch_DIR})")
      set(${_found} TRUE)
    endif()
  endif()
  if(NOT ${_found} AND "${_mode}" STREQUAL "REQUIRED")
    message(FATAL_ERROR "tidepool: ${Python3_EXECUTABLE} cannot import torch and no LibTorch "
                        "is installed in the system prefixes; run scripts/setup or pass "
                        "-DTIDEPOOL_WITH_TORCH=OFF to build only allocator/ and tiering/")
  endif()
endmacro()

if(TIDEPOOL_WITH_TORCH)
  tidepool_find_torch(_tidepool_torch_found REQUIRED)
  include(${CMAKE_CURRENT_LIST_DIR}/TidepoolTorchPch.cmake)
endif()
