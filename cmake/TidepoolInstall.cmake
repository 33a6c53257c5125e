# Install and export so that a C++ trainer can find_package(tidepool).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(_tidepool_targets tidepool)
foreach(_target tidepool_torch_cuda tidepool_optim)
  if(TARGET ${_target})
    list(APPEND _tidepool_targets ${_target})
  endif()
endforeach()
# Installed libraries find each other ($ORIGIN) and what they were linked against outside
# the build tree (LibTorch's lib/ inside the torch wheel) without LD_LIBRARY_PATH: a
# trainer linking tidepool::optim gets libc10_cuda etc. through libtidepool_optim's own
# RUNPATH, which the trainer's RUNPATH would not cover (it is not transitive).
set_target_properties(${_tidepool_targets} PROPERTIES
  INSTALL_RPATH "$ORIGIN" INSTALL_RPATH_USE_LINK_PATH TRUE)
install(TARGETS ${_tidepool_targets} EXPORT tidepoolTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT tidepoolTargets NAMESPACE tidepool::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tidepool)
configure_package_config_file(cmake/tidepoolConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tidepool)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/tidepoolConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tidepool)
