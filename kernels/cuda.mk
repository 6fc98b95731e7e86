# kernels/cuda.mk: the CUDA kernels and the GPU check; the Makefile includes it (after KERNEL_OBJ
# is defined) and `make cuda` builds:
#
#   $(BUILD)/cuda/libkvc_cuda.a   the .cu files of kernels/cuda/, behind kernels/cuda.h
#   $(BUILD)/bin/kvc-gpucheck      tests/gpu/gpucheck.c: every CUDA kernel against its CPU reference
#
# Built on every machine that has nvcc (CUDA=1, the Makefile's default when nvcc is found), so CI
# checks that the CUDA code compiles and links without a GPU; the CPU build never needs any of it.
# Code for sm_90 (H100, H200) plus compute_90 PTX that later GPUs JIT-compile. The CUDA runtime is
# linked statically and opens the driver with dlopen: nothing here links -lcuda, so kvc-gpucheck
# starts on a machine without a driver and says that there is no device.
#
# No --use_fast_math: the INT8 codes must be the CPU reference's bit for bit (IEEE division,
# round to nearest even), and expf must stay accurate.

CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_LIBDIR ?= $(dir $(firstword $(wildcard $(CUDA_HOME)/lib64/libcudart_static.a \
	$(CUDA_HOME)/targets/x86_64-linux/lib/libcudart_static.a)))
CUDA_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC,-Wall,-Wextra --Werror all-warnings

CUDA_SRC := $(wildcard kernels/cuda/*.cu)
CUDA_OBJ := $(patsubst %.cu,$(BUILD)/obj/%.o,$(CUDA_SRC))
CUDA_LIB := $(BUILD)/cuda/libkvc_cuda.a
GPUCHECK := $(BUILD)/bin/kvc-gpucheck
GPUCHECK_OBJ := $(BUILD)/obj/tests/gpu/gpucheck.o

$(BUILD)/obj/kernels/cuda/%.o: kernels/cuda/%.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Ikernels -MMD -MP -c $< -o $@

$(CUDA_LIB): $(CUDA_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# a C program of the CUDA runtime API: its headers, as system headers (no warnings of theirs)
$(GPUCHECK_OBJ): CFLAGS += -isystem $(CUDA_HOME)/include

$(GPUCHECK): $(GPUCHECK_OBJ) $(CUDA_LIB) $(KERNEL_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $(filter %.o,$^) $(CUDA_LIB) -o $@ -L$(CUDA_LIBDIR) -lcudart_static \
		-ldl -lrt -lpthread -lstdc++ $(LDLIBS)

ifeq ($(CUDA),1)
cuda: $(CUDA_LIB) $(GPUCHECK)
endif

# The same kernel sources compiled by the host C++ compiler against tests/gpu/emu (a host thread
# per CUDA thread, see kvc_emu.h), linked with the same harness: `make cuda-emu` builds
# $(BUILD)/emu/kvc-gpucheck-emu, and tests/gpu/emulate.sh runs its matrix of small cases against
# the CPU references. Needs no CUDA toolkit and no GPU, so any machine can check the kernels' index
# arithmetic, lane mappings and barriers; timing and the GPU memory model it cannot check.
# GCC 12 reports maybe-uninitialized falsely in the emulated kernels once ASan instruments them
# (the plain build is clean with the same flags): not an error in the sanitizer build alone.
EMU_SAN_NOWARN := -Wno-maybe-uninitialized
EMU_CXXFLAGS := -std=c++20 -O2 -g -fno-strict-aliasing -ffp-contract=off -Wall -Wextra -Werror \
	-Wno-unknown-pragmas -Itests/gpu/emu -Ikernels -MMD -MP $(if $(SAN),$(SAN_FLAGS) $(EMU_SAN_NOWARN))
EMU_OBJ := $(patsubst kernels/cuda/%.cu,$(BUILD)/emu/obj/%.o,$(CUDA_SRC)) $(BUILD)/emu/obj/emu.o
GPUCHECK_EMU := $(BUILD)/emu/kvc-gpucheck-emu

$(BUILD)/emu/obj/%.o: kernels/cuda/%.cu
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -x c++ -include kvc_emu.h -c $< -o $@

$(BUILD)/emu/obj/emu.o: tests/gpu/emu/emu.cc
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -c $< -o $@

$(BUILD)/emu/obj/gpucheck.o: tests/gpu/gpucheck.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/gpu/emu -c $< -o $@

$(GPUCHECK_EMU): $(BUILD)/emu/obj/gpucheck.o $(EMU_OBJ) $(KERNEL_OBJ)
	$(CXX) $(LDFLAGS) $^ -o $@ -pthread $(LDLIBS)

.PHONY: cuda-emu
cuda-emu: $(GPUCHECK_EMU)

-include $(wildcard $(BUILD)/emu/obj/*.d)

# tests/gpu/ipc.sh, the GPU pool check (docs/gpu.md): kvc-ipc-client maps kvcd's GPU pool through
# libkvc and compacts with the CUDA kernels (built by `make cuda`). For `ipc.sh --fake` the same
# client is linked with the emulated kernels, and a fake driver (tests/gpu/fakecuda.c, host memory
# behind the driver API) is built as libcuda.so.1 for kvcd and libkvc to dlopen: the whole flow on
# a CPU (`make cuda-emu` builds both).
IPC_CLIENT := $(BUILD)/bin/kvc-ipc-client
IPC_CLIENT_EMU := $(BUILD)/emu/kvc-ipc-client-emu
FAKECUDA_LIB := $(BUILD)/fakecuda/libcuda.so.1

$(BUILD)/obj/tests/gpu/ipc_client.o: CFLAGS += -isystem $(CUDA_HOME)/include

$(IPC_CLIENT): $(BUILD)/obj/tests/gpu/ipc_client.o $(CUDA_LIB) $(LIB)/libkvc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $< $(CUDA_LIB) $(LIB)/libkvc.a -o $@ -L$(CUDA_LIBDIR) -lcudart_static \
		-ldl -lrt -lpthread -lstdc++ $(LDLIBS_ZMQ) $(LDLIBS)

$(BUILD)/emu/obj/ipc_client.o: tests/gpu/ipc_client.c | $(GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/gpu/emu -c $< -o $@

$(IPC_CLIENT_EMU): $(BUILD)/emu/obj/ipc_client.o $(EMU_OBJ) $(LIB)/libkvc.a
	$(CXX) $(LDFLAGS) $^ -o $@ -pthread $(LDLIBS_ZMQ) $(LDLIBS)

$(FAKECUDA_LIB): tests/gpu/fakecuda.c kernels/cuda/driver.h
	@mkdir -p $(dir $@)
	$(CC) -std=gnu11 -O1 -g -fPIC -shared -Wall -Wextra -Werror -Ikernels -Wl,-soname,libcuda.so.1 $< -o $@

cuda-emu: $(IPC_CLIENT_EMU) $(FAKECUDA_LIB)
ifeq ($(CUDA),1)
cuda: $(IPC_CLIENT)
endif
