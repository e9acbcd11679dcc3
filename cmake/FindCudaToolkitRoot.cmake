# Decide whether to build the CUDA transport and find nvcc:
# CMAKE_CUDA_COMPILER, CUDA_HOME, /usr/local/cuda, then the pip package nvidia-cuda-nvcc.
set(JAX_CPGRAD_WITH_CUDA OFF)
if(NOT JAX_CPGRAD_CUDA STREQUAL "OFF")
  set(_nvcc_candidates "")
  if(DEFINED ENV{CUDA_HOME})
    list(APPEND _nvcc_candidates "$ENV{CUDA_HOME}/bin/nvcc")
  endif()
  list(APPEND _nvcc_candidates "/usr/local/cuda/bin/nvcc")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import nvidia.cuda_nvcc as m, os; print(os.path.join(list(m.__path__)[0], 'bin', 'nvcc'))"
    OUTPUT_VARIABLE _pip_nvcc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_pip_nvcc)
    list(APPEND _nvcc_candidates "${_pip_nvcc}")
  endif()
  if(NOT CMAKE_CUDA_COMPILER)
    foreach(_nvcc IN LISTS _nvcc_candidates)
      if(EXISTS "${_nvcc}")
        set(CMAKE_CUDA_COMPILER "${_nvcc}" CACHE FILEPATH "nvcc" FORCE)
        break()
      endif()
    endforeach()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(JAX_CPGRAD_WITH_CUDA ON)
    message(STATUS "jax_cpgrad: building the CUDA peer transport with ${CMAKE_CUDA_COMPILER}")
  else()
    string(CONCAT _how "Looked at CMAKE_CUDA_COMPILER, CUDA_HOME, /usr/local/cuda and the nvidia-cuda-nvcc "
             "package of the build environment. For the CUDA build: install the prebuilt CUDA wheel "
             "(scripts/build_wheel.sh), or set CUDA_HOME to a CUDA toolkit (or install "
             "nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-crt nvidia-cuda-cccl and build with "
             "pip's --no-build-isolation). JAX_CPGRAD_CUDA=OFF builds the CPU-only module on purpose.")
    # A GPU user usually has the CUDA runtime (jax[cuda]) but no compiler: on a machine with an
    # NVIDIA GPU, a CPU-only build would quietly lose the peer transport, so AUTO fails there.
    set(_gpus "")
    find_program(_nvidia_smi nvidia-smi)
    if(_nvidia_smi)
      execute_process(COMMAND "${_nvidia_smi}" -L OUTPUT_VARIABLE _gpus ERROR_QUIET TIMEOUT 30)
      string(REGEX MATCH "GPU 0:[^\n]*" _gpus "${_gpus}")
    endif()
    if(JAX_CPGRAD_CUDA STREQUAL "ON")
      message(FATAL_ERROR "jax_cpgrad: JAX_CPGRAD_CUDA=ON but no nvcc was found. ${_how}")
    elseif(_gpus)
      message(FATAL_ERROR "jax_cpgrad: this machine has an NVIDIA GPU (${_gpus}) but no nvcc was "
                          "found, so only the CPU-only module (no peer transport) could be built. "
                          "${_how}")
    else()
      message(WARNING "jax_cpgrad: NO CUDA TOOLKIT FOUND: building the CPU-only module. Workspace "
                      "(the peer transport) will not be available; calls without a workspace run "
                      "over XLA collectives. ${_how}")
    endif()
  endif()
endif()
if(JAX_CPGRAD_CUDA STREQUAL "OFF")
  message(STATUS "jax_cpgrad: JAX_CPGRAD_CUDA=OFF: building the CPU-only module (XLA transport)")
endif()
