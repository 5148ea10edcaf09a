# Read by CMake after the compiler's own rules (CMAKE_USER_MAKE_RULES_OVERRIDE_CXX,
# set by cxx20-toolchain.cmake): a target that asks for C++14 is compiled as
# C++20, which torch 2.14's headers need. GCC 12 compiles all of Horovod 0.28.1
# this way.
set(CMAKE_CXX14_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CXX14_EXTENSION_COMPILE_OPTION "-std=gnu++20")
