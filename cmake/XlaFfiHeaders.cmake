# The XLA FFI headers ship inside jaxlib; fail loudly when they cannot be found.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import jaxlib, os; p = os.path.join(os.path.dirname(jaxlib.__file__), 'include'); assert os.path.exists(os.path.join(p, 'xla/ffi/api/ffi.h')), p; print(p)"
  OUTPUT_VARIABLE XLA_FFI_INCLUDE_DIR OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _xla_result ERROR_VARIABLE _xla_error)
if(NOT _xla_result EQUAL 0)
  message(FATAL_ERROR "jax_cpgrad: cannot find the XLA FFI headers in jaxlib "
                      "(is jaxlib installed in the build environment?): ${_xla_error}")
endif()
message(STATUS "jax_cpgrad: XLA FFI headers from ${XLA_FFI_INCLUDE_DIR}")
