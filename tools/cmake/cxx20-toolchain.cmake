# Loaded by CMake through the CMAKE_TOOLCHAIN_FILE environment variable while
# pip builds Horovod 0.28.1 (see tools/setup.sh).
#
# Why: torch 2.14's headers refuse anything older than C++20, but Horovod
# 0.28.1's CMakeLists pins its torch extension to C++14
# (set(CMAKE_CXX_STANDARD 14)). Instead of editing Horovod's source we ask
# CMake to read a rules override after it has loaded the compiler's defaults;
# that override maps the "C++14" flag onto C++20 for every target.
set(CMAKE_USER_MAKE_RULES_OVERRIDE_CXX "${CMAKE_CURRENT_LIST_DIR}/cxx14-means-cxx20.cmake")
