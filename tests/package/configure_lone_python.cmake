# Copies python/ (SOURCE) into an empty folder (WORK/python) and configures it as
# scikit-build-core would (SKBUILD set): run by package.python_alone_says_why, which
# passes when that configure stops with the message that says why.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
file(COPY "${SOURCE}/CMakeLists.txt" DESTINATION "${WORK}/python")
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${WORK}/python" -B "${WORK}/build" -DSKBUILD=ON
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(result EQUAL 0)
  message(FATAL_ERROR "python/ alone configured: the missing repository went unnoticed")
endif()
string(REGEX REPLACE "[ \n]+" " " flat "${err}")  # CMake wraps its error text
if(NOT flat MATCHES "builds libtidepool from the repository around python/, which is not here")
  message(FATAL_ERROR "python/ alone failed without saying why:\n${out}${err}")
endif()
