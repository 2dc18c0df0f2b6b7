"""The Python client's GPU side, checked on a machine without a GPU
(client/python/weightd/_cuda.py, client.py fetch(device=...)).

What runs here:
* ctypes layouts and enum values of CUmemLocation / CUmemAllocationProp /
  CUmemAccessDesc / CUuuid equal the C compiler's for cuda.h (a helper
  program compiled at test time; skipped without gcc or cuda.h).
* The driver sequence of vmm_alloc / free / export_fd / host registration,
  against a fake libcuda.so.1 compiled here from cuda.h's own prototypes
  (so every symbol name and signature the client uses is checked against the
  header): struct contents passed, size rounding, context push/pop and
  retain/release balance, rollback when a step fails, error codes and texts,
  the exported fd being the memory at .ptr.
* Pure helpers: UUID parsing/formatting, device parsing, pull pin ranges,
  byte views of every dtype (CPU tensors standing in for CUDA ones), the
  CUDA push request bytes decoded field by field.
* The device paths end to end with stand-ins for what needs CUDA (torch's
  device check, the tensor over device memory -- a CPU tensor over the fake
  allocation that holds it as torch's CUDA-array-interface path would --,
  torch.cuda.synchronize, and the daemon's CUDA copy, done by the real
  daemon as a host push of the same lease into the fake allocation's fd):
  push handles (bytes, offsets, one allocation, lifetime: a tensor kept after
  release() holds the allocation, the last one frees it), refresh() of a
  CUDA push handle after `apply` (only the targets rewritten, in place), and
  pull (read-only maps, pinned ranges registered read-only and unregistered,
  pinning refused or off, the lease ended at once).
* Zero-copy and export per device: the fake driver answers as an x86 H100
  (no pageable access, no read-only registration: zero-copy refused at
  once, FAILED_PRECONDITION naming both attributes, no Fetch made), an x86
  H100 with HMM and a GH200 (host addresses), or a device with read-only
  registration only (mapped registrations); every tensor lies inside the
  ranges the handle reports, which are read-only shared maps of the
  daemon's memfds (zero-copy) or the import (export: read-only, or
  read-write where the driver refused, recorded on the handle);
  handle.read_only says which tensors must not be written.
* Against a real daemon (a CUDA build, no driver here): fetch(device=...)
  argument errors and FAILED_PRECONDITION naming the missing CUDA, with no
  lease taken; raw CUDA pushes (a memfd standing in for the VMM fd) answered
  FAILED_PRECONDITION "the daemon has no GPU" (with our UUID as the daemon
  prints it), bad targets INVALID_ARGUMENT, the connection serving a good
  host push after each; and fetch(device="cuda:0") through the fake driver
  up to the daemon's refusal, with the allocation and fds released.
* tests/gpu/gpu_checks.py: its no-GPU path and its pure helpers, its time
  budget (checks that would not fit skipped, not started), its parsing of
  the daemon's log, its verdict on where a kill landed and its "killed"
  check run here on a host push, and the NaN sweep's references against the
  daemon's CPU casts (c10's NaN encodings).

What cannot run here: the real driver, torch's CUDA tensors over VMM memory
(tensor_from_ptr), the daemon's CUDA copies: tests/gpu/gpu_checks.py on a
device.
"""
import ctypes
import gc
import importlib.util
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import BUILD, REPO, Daemon, user_prefix  # noqa: E402
from harness import leases_open as _leases, wait_leases as _wait_leases  # noqa: E402
import st_io  # noqa: E402

import weightd  # noqa: E402  (build/python, put on sys.path by harness)
from weightd import _cuda, _datasock  # noqa: E402
from weightd.v1 import weightd_pb2 as pb  # noqa: E402

CUDA_INCLUDE = "/usr/local/cuda/include"
OK, INVALID_ARGUMENT, FAILED_PRECONDITION, UNIMPLEMENTED = 0, 3, 9, 12
UUID = bytes(range(0xA0, 0xB0))
UUID_TEXT = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf"


def _need_cc():
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    if not os.path.exists(os.path.join(CUDA_INCLUDE, "cuda.h")):
        pytest.skip("no %s/cuda.h" % CUDA_INCLUDE)


def _compile(tmp, name, source, shared=False):
    src = os.path.join(tmp, name + ".c")
    out = os.path.join(tmp, ("lib%s.so" % name) if shared else name)
    with open(src, "w") as f:
        f.write(source)
    cmd = ["gcc", "-std=gnu11", "-Wall", "-Werror", "-I", CUDA_INCLUDE, "-o", out, src]
    if shared:
        cmd[1:1] = ["-shared", "-fPIC"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


# ---------------------------------------------------------------- layouts

LAYOUT_C = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
#define F(T, f) printf("\"%s.%s\": %zu,\n", #T, #f, offsetof(T, f))
#define S(T) printf("\"%s\": %zu,\n", #T, sizeof(T))
#define E(v) printf("\"%s\": %lld,\n", #v, (long long)(v))
int main(void) {
  printf("{\n");
  S(CUmemLocation); F(CUmemLocation, type); F(CUmemLocation, id);
  S(CUmemAllocationProp); F(CUmemAllocationProp, type);
  F(CUmemAllocationProp, requestedHandleTypes); F(CUmemAllocationProp, location);
  F(CUmemAllocationProp, win32HandleMetaData); F(CUmemAllocationProp, allocFlags);
  F(CUmemAllocationProp, allocFlags.compressionType);
  F(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
  F(CUmemAllocationProp, allocFlags.usage); F(CUmemAllocationProp, allocFlags.reserved);
  S(CUmemAccessDesc); F(CUmemAccessDesc, location); F(CUmemAccessDesc, flags);
  S(CUuuid); S(CUdeviceptr); S(CUmemGenericAllocationHandle); S(CUdevice);
  S(CUmemAllocationType); S(CUmemAllocationHandleType); S(CUmemLocationType);
  S(CUmemAccess_flags);
  E(CU_MEM_ALLOCATION_TYPE_PINNED); E(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  E(CU_MEM_LOCATION_TYPE_DEVICE); E(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  E(CU_MEM_ALLOC_GRANULARITY_MINIMUM); E(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  E(CU_MEMHOSTREGISTER_READ_ONLY);
  E(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  E(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
  E(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED);
  E(CUDA_ERROR_OUT_OF_MEMORY); E(CUDA_ERROR_NOT_INITIALIZED); E(CUDA_ERROR_DEINITIALIZED);
  E(CUDA_ERROR_STUB_LIBRARY); E(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER);
  E(CUDA_ERROR_DEVICE_UNAVAILABLE); E(CUDA_ERROR_NO_DEVICE); E(CUDA_ERROR_INVALID_DEVICE);
  E(CUDA_ERROR_DEVICE_NOT_LICENSED); E(CUDA_ERROR_NOT_PERMITTED); E(CUDA_ERROR_NOT_SUPPORTED);
  E(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH); E(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE);
  printf("\"end\": 0}\n");
  return 0;
}
"""


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    _need_cc()
    exe = _compile(str(tmp_path_factory.mktemp("layout")), "layout", LAYOUT_C)
    return json.loads(subprocess.run([exe], capture_output=True, text=True, check=True).stdout)


def test_struct_layouts_match_cuda_h(c_layout):
    c = c_layout
    structs = {"CUmemLocation": _cuda.CUmemLocation,
               "CUmemAllocationProp": _cuda.CUmemAllocationProp,
               "CUmemAccessDesc": _cuda.CUmemAccessDesc, "CUuuid": _cuda.CUuuid}
    for name, cls in structs.items():
        assert ctypes.sizeof(cls) == c[name], name
        size, offsets = _cuda.LAYOUT[name]
        assert size == c[name], name
        for field, _ in cls._fields_:
            key = "%s.%s" % (name, field)
            if key in c:
                assert getattr(cls, field).offset == c[key], key
                assert offsets[field] == c[key], key
    flags = _cuda.CUmemAllocFlags
    base = _cuda.CUmemAllocationProp.allocFlags.offset
    for field in ("compressionType", "gpuDirectRDMACapable", "usage", "reserved"):
        assert base + getattr(flags, field).offset == \
            c["CUmemAllocationProp.allocFlags.%s" % field], field
    assert ctypes.sizeof(flags) == c["CUmemAllocationProp"] - base
    # The scalar types the prototypes use.
    assert ctypes.sizeof(ctypes.c_ulonglong) == c["CUdeviceptr"] == \
        c["CUmemGenericAllocationHandle"]
    assert ctypes.sizeof(ctypes.c_int) == c["CUdevice"] == c["CUmemAllocationType"] == \
        c["CUmemAllocationHandleType"] == c["CUmemLocationType"] == c["CUmemAccess_flags"]


def test_enum_values_match_cuda_h(c_layout):
    for name in ("CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
                 "CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
                 "CU_MEM_ALLOC_GRANULARITY_MINIMUM", "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED",
                 "CU_MEMHOSTREGISTER_READ_ONLY",
                 "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED"):
        assert getattr(_cuda, name) == c_layout[name], name
    assert _cuda.HANDLE_VMM_POSIX_FD == c_layout["CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"]
    assert _cuda._OOM == c_layout["CUDA_ERROR_OUT_OF_MEMORY"]
    precondition = {c_layout[n] for n in (
        "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_DEINITIALIZED", "CUDA_ERROR_STUB_LIBRARY",
        "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER", "CUDA_ERROR_DEVICE_UNAVAILABLE",
        "CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_INVALID_DEVICE", "CUDA_ERROR_DEVICE_NOT_LICENSED",
        "CUDA_ERROR_NOT_PERMITTED", "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE")}
    assert _cuda._PRECONDITION_ERRORS == precondition


# ---------------------------------------------------------------- fake driver

# Every entry point _cuda.py uses, defined through cuda.h's own prototypes
# (its #defines give the _v2 symbols). "Device memory" is a memfd: cuMemMap
# maps it at the reserved address (PROT_NONE until cuMemSetAccess), and the
# exported fd is a dup of it, so the test can see the pointer and the fd
# name the same bytes. The memfd is allocated and sealed against shrinking
# and growing, as a host push wants: the end-to-end tests below have the real daemon
# host-push into it in place of the CUDA push it cannot do here.
FAKE_C = r"""
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAXA 64
static struct { int used, memfd; size_t size; } allocs[MAXA];
static int live, retained, depth, syncs, registered, reserved, mapped, bad;
static char fail_name[64];
static int fail_code;
static char logbuf[1 << 16];
static size_t loglen;
static size_t gran_min = 2u << 20, gran_rec = 2u << 20;
static int attrs[256];

static void say(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (loglen < sizeof(logbuf) - 256) {
    loglen += vsnprintf(logbuf + loglen, sizeof(logbuf) - loglen, fmt, ap);
    logbuf[loglen++] = '\n';
    logbuf[loglen] = 0;
  }
  va_end(ap);
}
static int failing(const char* name) {
  if (fail_code && strcmp(name, fail_name) == 0) { int c = fail_code; fail_code = 0; return c; }
  return 0;
}
#define FAIL(name) do { int c_ = failing(name); if (c_) { say("%s failed %d", name, c_); \
  return (CUresult)c_; } } while (0)
#define NEED_CTX() do { if (depth <= 0) { bad++; return CUDA_ERROR_INVALID_CONTEXT; } } while (0)

void fake_reset(void) {
  fail_code = 0; loglen = 0; logbuf[0] = 0; gran_min = gran_rec = 2u << 20;
  for (int i = 0; i < 256; i++) attrs[i] = 1;
}
void fake_fail(const char* name, int code) {
  strncpy(fail_name, name, sizeof(fail_name) - 1); fail_code = code;
}
void fake_granularity(size_t mn, size_t rec) { gran_min = mn; gran_rec = rec; }
void fake_attr(int attr, int value) { attrs[attr] = value; }
const char* fake_log(void) { return logbuf; }
void fake_counters(int* out) {
  out[0] = live; out[1] = retained; out[2] = depth; out[3] = syncs; out[4] = registered;
  out[5] = reserved; out[6] = mapped; out[7] = bad;
}

CUresult CUDAAPI cuInit(unsigned int flags) { FAIL("cuInit"); say("cuInit %u", flags); return 0; }
CUresult CUDAAPI cuGetErrorName(CUresult e, const char** s) {
  *s = e == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_FAKE"; return 0;
}
CUresult CUDAAPI cuGetErrorString(CUresult e, const char** s) { *s = "fake error text"; return 0; }
CUresult CUDAAPI cuDeviceGet(CUdevice* d, int ordinal) {
  FAIL("cuDeviceGet");
  if (ordinal < 0 || ordinal > 1) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal; return 0;
}
CUresult CUDAAPI cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  FAIL("cuDeviceGetAttribute");
  if ((int)a < 0 || (int)a >= 256) return CUDA_ERROR_INVALID_VALUE;
  say("attr %d dev %d", (int)a, d); *v = attrs[a]; return 0;
}
CUresult CUDAAPI cuDeviceGetUuid(CUuuid* u, CUdevice d) {
  for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0xa0 + i);
  return 0;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  FAIL("cuDevicePrimaryCtxRetain");
  *c = (CUcontext)(uintptr_t)(0x1000 + d); retained++; return 0;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice d) { retained--; return 0; }
CUresult CUDAAPI cuCtxPushCurrent(CUcontext c) {
  FAIL("cuCtxPushCurrent");
  if ((uintptr_t)c < 0x1000 || (uintptr_t)c > 0x1001) { bad++; return CUDA_ERROR_INVALID_CONTEXT; }
  depth++; return 0;
}
CUresult CUDAAPI cuCtxPopCurrent(CUcontext* c) {
  if (depth <= 0) { bad++; return CUDA_ERROR_INVALID_CONTEXT; }
  depth--; if (c) *c = (CUcontext)(uintptr_t)0x1000; return 0;
}
CUresult CUDAAPI cuCtxSynchronize(void) { NEED_CTX(); syncs++; say("sync"); return 0; }

static int good_prop(const CUmemAllocationProp* p) {
  say("prop type=%d handles=%d loc=%d/%d win32=%p flags=%d/%d/%d/%d%d%d%d", (int)p->type,
      (int)p->requestedHandleTypes, (int)p->location.type, p->location.id,
      p->win32HandleMetaData, p->allocFlags.compressionType,
      p->allocFlags.gpuDirectRDMACapable, p->allocFlags.usage, p->allocFlags.reserved[0],
      p->allocFlags.reserved[1], p->allocFlags.reserved[2], p->allocFlags.reserved[3]);
  return p->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         p->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR &&
         p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && p->location.id >= 0 &&
         p->location.id <= 1 && p->win32HandleMetaData == NULL &&
         p->allocFlags.compressionType == 0 && p->allocFlags.gpuDirectRDMACapable == 0 &&
         p->allocFlags.usage == 0;
}
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* p,
                                               CUmemAllocationGranularity_flags o) {
  FAIL("cuMemGetAllocationGranularity"); NEED_CTX();
  if (!good_prop(p)) { bad++; return CUDA_ERROR_INVALID_VALUE; }
  *g = o == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED ? gran_rec : gran_min; return 0;
}
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* h, size_t size,
                             const CUmemAllocationProp* p, unsigned long long flags) {
  FAIL("cuMemCreate"); NEED_CTX();
  if (!good_prop(p) || size == 0 || size % gran_min || flags) { bad++; return CUDA_ERROR_INVALID_VALUE; }
  for (int i = 0; i < MAXA; i++) {
    if (allocs[i].used) continue;
    int fd = memfd_create("fake-vmm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, size) != 0 || fallocate(fd, 0, 0, size) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    allocs[i].used = 1; allocs[i].memfd = fd; allocs[i].size = size;
    *h = (CUmemGenericAllocationHandle)(i + 1); live++;
    say("create %zu -> %d", size, i + 1); return 0;
  }
  return CUDA_ERROR_OUT_OF_MEMORY;
}
static int slot(CUmemGenericAllocationHandle h) {
  int i = (int)h - 1; return i >= 0 && i < MAXA && allocs[i].used ? i : -1;
}
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle h) {
  int i = slot(h); if (i < 0) { bad++; return CUDA_ERROR_INVALID_VALUE; }
  close(allocs[i].memfd); allocs[i].used = 0; live--; say("release %d", i + 1); return 0;
}
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t align,
                                     CUdeviceptr addr, unsigned long long flags) {
  FAIL("cuMemAddressReserve"); NEED_CTX();
  void* p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = (CUdeviceptr)(uintptr_t)p; reserved++; say("reserve %zu", size); return 0;
}
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  NEED_CTX(); munmap((void*)(uintptr_t)ptr, size); reserved--; say("address free"); return 0;
}
CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle h, unsigned long long flags) {
  FAIL("cuMemMap"); NEED_CTX();
  int i = slot(h);
  if (i < 0 || size != allocs[i].size || offset || flags) { bad++; return CUDA_ERROR_INVALID_VALUE; }
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, allocs[i].memfd, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_INVALID_VALUE;
  mapped++; say("map"); return 0;
}
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  NEED_CTX();
  mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  mapped--; say("unmap"); return 0;
}
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                                size_t count) {
  FAIL("cuMemSetAccess"); NEED_CTX();
  say("access loc=%d/%d flags=%d count=%zu", (int)desc->location.type, desc->location.id,
      (int)desc->flags, count);
  if (count != 1 || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
      (desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE &&
       desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READ)) { bad++; return CUDA_ERROR_INVALID_VALUE; }
  int prot = desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READ ? PROT_READ : PROT_READ | PROT_WRITE;
  return mprotect((void*)(uintptr_t)ptr, size, prot) == 0 ? 0 : CUDA_ERROR_INVALID_VALUE;
}
/* Another process's export: the fd's memory (its size is the fd's). */
CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* handle,
                                                CUmemAllocationHandleType type) {
  FAIL("cuMemImportFromShareableHandle"); NEED_CTX();
  int fd = (int)(intptr_t)handle;
  struct stat st;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fstat(fd, &st) != 0) {
    bad++; return CUDA_ERROR_INVALID_VALUE;
  }
  for (int i = 0; i < MAXA; i++) {
    if (allocs[i].used) continue;
    allocs[i].used = 1; allocs[i].memfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    allocs[i].size = (size_t)st.st_size;
    *h = (CUmemGenericAllocationHandle)(i + 1); live++;
    say("import %zu -> %d", allocs[i].size, i + 1); return 0;
  }
  return CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                              CUmemAllocationHandleType type,
                                              unsigned long long flags) {
  FAIL("cuMemExportToShareableHandle"); NEED_CTX();
  int i = slot(h);
  if (i < 0 || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags) { bad++; return CUDA_ERROR_INVALID_VALUE; }
  *(int*)out = fcntl(allocs[i].memfd, F_DUPFD_CLOEXEC, 0); say("export"); return 0;
}
CUresult CUDAAPI cuMemHostRegister(void* p, size_t n, unsigned int flags) {
  FAIL("cuMemHostRegister"); NEED_CTX();
  say("host register %zu flags %u aligned %d at %p", n, flags,
      (int)((uintptr_t)p % 4096 == 0), p);
  if (flags != CU_MEMHOSTREGISTER_READ_ONLY &&
      flags != (CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_DEVICEMAP)) {
    bad++; return CUDA_ERROR_INVALID_VALUE;
  }
  /* as the driver: READ_ONLY where the device lacks it is not supported */
  if (!attrs[CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED]) {
    bad++; return CUDA_ERROR_NOT_SUPPORTED;
  }
  registered++; return 0;
}
CUresult CUDAAPI cuMemHostUnregister(void* p) { NEED_CTX(); registered--; say("host unregister"); return 0; }
/* Unified addressing: a registered range's device address is its host one. */
CUresult CUDAAPI cuMemHostGetDevicePointer(CUdeviceptr* d, void* p, unsigned int flags) {
  FAIL("cuMemHostGetDevicePointer"); NEED_CTX();
  if (flags != 0 || registered <= 0) { bad++; return CUDA_ERROR_INVALID_VALUE; }
  say("device pointer"); *d = (CUdeviceptr)(uintptr_t)p; return 0;
}
"""


# cuDeviceGetAttribute's answers on real machines (the rest as the fake's
# default, 1): an x86 H100 (PCIe or SXM host, no HMM: public reports with
# drivers 595 and 610 show READ_ONLY_HOST_REGISTER_SUPPORTED 0), the same
# with HMM (open kernel modules: pageable memory access), and a GH200
# (NVLink-C2C, ATS: both).
DEVICE_PROFILES = {
    "x86-h100": {_cuda.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: 0,
                 _cuda.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: 0},
    "x86-h100-hmm": {_cuda.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: 1,
                     _cuda.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: 0},
    "gh200": {_cuda.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: 1,
              _cuda.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: 1},
    # no pageable access, read-only registration: the mapped-registration path
    "read-only-register": {_cuda.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: 0,
                           _cuda.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: 1},
}


class Fake:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.fake_log.restype = ctypes.c_char_p
        self.lib.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.lib.fake_granularity.argtypes = [ctypes.c_size_t, ctypes.c_size_t]

    def counters(self):
        out = (ctypes.c_int * 8)()
        self.lib.fake_counters(out)
        return dict(zip(("live", "retained", "depth", "syncs", "registered", "reserved",
                         "mapped", "bad"), list(out)))

    def log(self):
        return self.lib.fake_log().decode()

    def fail(self, name, code):
        self.lib.fake_fail(name.encode(), code)

    def profile(self, name):
        for attr, value in DEVICE_PROFILES[name].items():
            self.lib.fake_attr(attr, value)

    def assert_clean(self):
        c = self.counters()
        assert (c["live"], c["retained"], c["depth"], c["registered"], c["reserved"],
                c["mapped"], c["bad"]) == (0, 0, 0, 0, 0, 0, 0), (c, self.log())


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory):
    _need_cc()
    return _compile(str(tmp_path_factory.mktemp("fakecuda")), "fakecuda", FAKE_C, shared=True)


@pytest.fixture
def fake(fake_lib):
    f = Fake(fake_lib)
    f.lib.fake_reset()
    _cuda._use_driver(fake_lib)
    try:
        yield f
    finally:
        gc.collect()
        _cuda._use_driver("libcuda.so.1")


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


def test_vmm_alloc_sequence_and_rounding(fake):
    fds = _open_fds()
    mib2 = 2 << 20
    for want, got in ((0, mib2), (1, mib2), (mib2, mib2), (mib2 + 1, 2 * mib2)):
        a = _cuda.vmm_alloc(0, want)
        assert a.size == got and a.ptr and a.ptr % 4096 == 0 and a.fd >= 0, (want, a)
        assert os.fstat(a.fd).st_size == got
        # The pointer and the exported fd are the same memory.
        ctypes.memset(a.ptr + 7, 0x5A, 3)
        assert os.pread(a.fd, 5, 6) == b"\0ZZZ\0"
        fd2 = a.export_fd()
        assert fd2 != a.fd and os.pread(fd2, 3, 7) == b"ZZZ"
        os.close(fd2)
        a.close_fd()
        assert a.fd == -1
        a.close_fd()  # idempotent
        a.free()
        assert a.freed
        a.free()  # idempotent
        with pytest.raises(weightd.Error) as e:
            a.export_fd()
        assert e.value.code == "FAILED_PRECONDITION"
    fake.assert_clean()
    log = fake.log()
    assert "prop type=1 handles=1 loc=1/0 win32=(nil) flags=0/0/0/0000" in log, log
    assert "access loc=1/0 flags=3 count=1" in log, log
    assert log.count("sync") == 4  # free() waits for the device before unmapping
    assert _open_fds() == fds


def test_vmm_alloc_recommended_granularity_and_device_1(fake):
    fake.lib.fake_granularity(2 << 20, 8 << 20)
    a = _cuda.vmm_alloc(1, 3 << 20)
    assert a.size == 8 << 20 and a.granularity == 8 << 20 and a.ordinal == 1
    assert "loc=1/1" in fake.log()
    a.free()
    # A recommended granularity that is not a multiple of the minimum: the minimum.
    fake.lib.fake_granularity(2 << 20, 3 << 20)
    a = _cuda.vmm_alloc(0, 3 << 20)
    assert a.size == 4 << 20
    a.free()
    fake.assert_clean()


def test_vmm_alloc_freed_when_collected(fake):
    fds = _open_fds()
    a = _cuda.vmm_alloc(0, 100)
    assert fake.counters()["live"] == 1
    del a
    gc.collect()
    fake.assert_clean()
    assert _open_fds() == fds


@pytest.mark.parametrize("step,code,want", [
    ("cuMemGetAllocationGranularity", 1, "INTERNAL"),
    ("cuMemCreate", 2, "RESOURCE_EXHAUSTED"),
    ("cuMemAddressReserve", 2, "RESOURCE_EXHAUSTED"),
    ("cuMemMap", 1, "INTERNAL"),
    ("cuMemSetAccess", 1, "INTERNAL"),
    ("cuMemExportToShareableHandle", 801, "FAILED_PRECONDITION"),
    ("cuDevicePrimaryCtxRetain", 101, "FAILED_PRECONDITION"),
    ("cuCtxPushCurrent", 201, "INTERNAL"),
])
def test_vmm_alloc_rolls_back_a_failed_step(fake, step, code, want):
    fds = _open_fds()
    fake.fail(step, code)
    with pytest.raises(weightd.Error) as e:
        _cuda.vmm_alloc(0, 5 << 20)
    assert e.value.code == want, e.value
    assert "fake error text" in e.value.message and "(%d)" % code in e.value.message, e.value
    gc.collect()
    fake.assert_clean()
    assert _open_fds() == fds


def test_vmm_alloc_refuses_a_device_without_vmm(fake):
    fake.lib.fake_attr(_cuda.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0)
    with pytest.raises(weightd.Error) as e:
        _cuda.vmm_alloc(0, 1)
    assert e.value.code == "FAILED_PRECONDITION" and "virtual memory" in e.value.message
    fake.lib.fake_reset()
    fake.lib.fake_attr(_cuda.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0)
    with pytest.raises(weightd.Error) as e:
        _cuda.vmm_alloc(0, 1)
    assert e.value.code == "FAILED_PRECONDITION" and "POSIX fd" in e.value.message
    with pytest.raises(weightd.Error) as e:
        _cuda.vmm_alloc(7, 1)
    assert e.value.code == "FAILED_PRECONDITION" and "CUDA device 7" in e.value.message
    gc.collect()
    fake.assert_clean()


def test_host_register_read_only(fake):
    import mmap
    fd = os.memfd_create("pin")
    os.ftruncate(fd, 1 << 20)
    m = mmap.mmap(fd, 1 << 20, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    import numpy as np
    addr = np.frombuffer(m, dtype=np.uint8).__array_interface__["data"][0]
    r = _cuda.host_register_read_only(0, addr + 4096, 8192)
    assert fake.counters()["registered"] == 1
    assert "host register 8192 flags 8 aligned 1" in fake.log()
    r.unregister()
    r.unregister()  # idempotent
    fake.lib.fake_attr(_cuda.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, 0)
    with pytest.raises(weightd.Error) as e:
        _cuda.host_register_read_only(0, addr, 4096)
    assert e.value.code == "FAILED_PRECONDITION"
    fake.lib.fake_reset()
    fake.fail("cuMemHostRegister", 712)
    with pytest.raises(weightd.Error):
        _cuda.host_register_read_only(0, addr, 4096)
    gc.collect()
    fake.assert_clean()
    del m


def test_gpu_uuid_from_the_driver(fake):
    d = _cuda.driver()
    out = _cuda.CUuuid()
    d.call("cuDeviceGetUuid_v2", ctypes.byref(out), 0)
    assert bytes(out.bytes) == UUID


def test_missing_driver():
    _cuda._use_driver("/nonexistent/libcuda.so.1")
    try:
        with pytest.raises(weightd.Error) as e:
            _cuda.vmm_alloc(0, 1)
        assert e.value.code == "FAILED_PRECONDITION"
        assert "/nonexistent/libcuda.so.1" in e.value.message and "driver" in e.value.message
    finally:
        _cuda._use_driver("libcuda.so.1")
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(weightd.Error) as e:
            _cuda.driver()
        assert e.value.code == "FAILED_PRECONDITION" and "libcuda.so.1" in e.value.message


# ---------------------------------------------------------------- pure helpers


def test_uuid_parsing():
    assert _cuda.parse_gpu_uuid(UUID_TEXT) == UUID
    assert _cuda.parse_gpu_uuid(UUID_TEXT[4:]) == UUID  # torch's str(props.uuid)
    assert _cuda.parse_gpu_uuid(UUID_TEXT.upper().replace("GPU-", "GPU-")) == UUID
    assert _cuda.parse_gpu_uuid("MIG-" + UUID_TEXT[4:]) == UUID
    assert _cuda.parse_gpu_uuid(" %s\n" % UUID_TEXT) == UUID
    assert _cuda.parse_gpu_uuid(UUID) == UUID
    assert _cuda.parse_gpu_uuid(list(UUID)) == UUID
    assert _cuda.format_gpu_uuid(UUID) == UUID_TEXT
    for bad in ("", "GPU-", UUID_TEXT[:-1], UUID_TEXT + "0", UUID_TEXT.replace("a0", "g0"),
                UUID_TEXT[4:].replace("-", ""), b"short", [1] * 15, [256] + [0] * 15):
        with pytest.raises(weightd.Error) as e:
            _cuda.parse_gpu_uuid(bad)
        assert e.value.code == "INVALID_ARGUMENT", bad


def test_parse_device():
    P = _cuda.parse_device
    assert P(None) is None and P("cpu") is None and P(torch.device("cpu")) is None
    assert P(0) == 0 and P(3) == 3 and P("cuda:0") == 0 and P("CUDA:2") == 2
    assert P(torch.device("cuda", 1)) == 1 and P("cuda") == -1 and P(torch.device("cuda")) == -1
    for bad in (-1, True, "cuda:", "cuda:x", "cuda:-1", "mps", "meta", "cuda:0:1", 1.0, "cpu:1",
                torch.device("meta")):
        with pytest.raises(weightd.Error) as e:
            P(bad)
        assert e.value.code == "INVALID_ARGUMENT", bad


def test_round_up_and_pin_ranges():
    assert _cuda.round_up(0, 4) == 4 and _cuda.round_up(4, 4) == 4 and _cuda.round_up(5, 4) == 8
    with pytest.raises(weightd.Error):
        _cuda.round_up(1, 0)
    P = _cuda.pin_ranges
    assert P([], [100]) == []
    assert P([(0, 10, 0)], [100]) == []  # empty tensors pin nothing
    assert P([(0, 10, 20)], [1 << 20]) == [(0, 0, 4096)]
    # Whole pages (the segment's map covers its last page); merged when
    # close; separate segments apart.
    assert P([(0, 4000, 200), (0, 5000, 100)], [6000]) == [(0, 0, 8192)]
    assert P([(0, 5000, 100)], [5100]) == [(0, 4096, 8192)]
    assert P([(0, 0, 10), (0, 10 << 20, 10), (1, 8192, 1)], [20 << 20, 1 << 20],
             merge_gap=1 << 20) == [(0, 0, 4096), (0, 10 << 20, (10 << 20) + 4096),
                                    (1, 8192, 12288)]
    # Never two ranges on one page, however small the gap asked for.
    rs = P([(0, 0, 10), (0, 4100, 10)], [1 << 20], merge_gap=1)
    assert rs == [(0, 0, 8192)]


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool] + \
    [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def test_view_bytes_every_dtype():
    """view_bytes on a CPU uint8 tensor (the CUDA code path minus the device)."""
    g = torch.Generator().manual_seed(5)
    raw = torch.zeros(1 << 16, dtype=torch.uint8)
    at = 0
    for dt in DTYPES:
        for shape in ((3, 5), (), (7,), (0, 4), (2, 0, 3)):
            n = 1
            for d in shape:
                n *= d
            if dt == torch.bool:
                want = torch.rand(shape, generator=g) > 0.5
            elif dt.is_floating_point:
                want = torch.randn(shape, generator=g).to(dt)
            else:
                want = torch.randint(-100 if dt != torch.uint8 else 0, 100, shape,
                                     generator=g).to(dt)
            length = n * want.element_size()
            if length:
                raw[at:at + length] = want.contiguous().reshape(-1).view(torch.uint8)
            got = _cuda.view_bytes(raw, at, length, dt, shape)
            assert got.dtype == dt and tuple(got.shape) == shape, (dt, shape)
            if length:
                assert got.data_ptr() == raw.data_ptr() + at  # a view, no copy
                assert torch.equal(got.reshape(-1).view(torch.uint8),
                                   want.reshape(-1).view(torch.uint8)), (dt, shape)
            at = -(-(at + length) // 256) * 256


def test_device_array_interface():
    """What torch.as_tensor is handed: CUDA array interface v3, one flat
    writable uint8 range (bf16/fp8/bool are views of it), and the owner."""
    owner = object()
    a = _cuda._DeviceArray(0x7F0000001000, 4096, owner)
    assert a.__cuda_array_interface__ == {"shape": (4096,), "typestr": "|u1",
                                          "data": (0x7F0000001000, False), "version": 3,
                                          "strides": None}
    assert a.owner is owner


def _decode_by_hand(data):
    """CudaPushTarget et al. by byte offset, independent of _cuda's structs."""
    le = lambda b: int.from_bytes(b, "little")  # noqa: E731
    out = {"magic": data[0:4], "num_offsets": le(data[4:8]), "lease_id": le(data[8:16]),
           "token": data[16:32], "gpu_uuid": data[32:48], "size": le(data[48:56]),
           "handle_kind": le(data[56:60]), "reserved": le(data[60:64]),
           "ipc_handle": data[64:128]}
    rest = data[128:]
    out["offsets"] = [le(rest[i:i + 8]) for i in range(0, len(rest), 8)]
    return out


def test_cuda_push_request_bytes():
    token = bytes(range(16))
    header, rest = _cuda.cuda_push_request(0x0102030405060708, token, UUID, 6 << 20,
                                           [0, 256, 4096])
    assert len(header) == 32 and len(rest) == 96 + 24
    d = _decode_by_hand(header + rest)
    assert d == {"magic": b"WDC1", "num_offsets": 3, "lease_id": 0x0102030405060708,
                 "token": token, "gpu_uuid": UUID, "size": 6 << 20, "handle_kind": 1,
                 "reserved": 0, "ipc_handle": bytes(64), "offsets": [0, 256, 4096]}
    assert _cuda.decode_cuda_push_request(header + rest) == d
    # The default layout: no offsets, count 0.
    header, rest = _cuda.cuda_push_request(9, token, UUID, 2 << 20)
    d = _decode_by_hand(header + rest)
    assert (d["num_offsets"], d["offsets"], len(rest)) == (0, [], 96)
    # A legacy handle and an explicit count (what the raw tests send).
    header, rest = _cuda.cuda_push_request(9, token, UUID, 1, [5], num_offsets=7,
                                           handle_kind=2, ipc_handle=b"\x01" * 64)
    d = _decode_by_hand(header + rest)
    assert (d["num_offsets"], d["handle_kind"], d["ipc_handle"], d["offsets"]) == \
        (7, 2, b"\x01" * 64, [5])
    # The same header layout as a host push.
    assert header[4:] == _datasock._PUSH.pack(b"WDP1", 7, 9, token)[4:]
    for bad in ({"token": b"x"}, {"gpu_uuid": b"x"}, {"ipc_handle": b"x" * 65}):
        args = dict(lease_id=1, token=token, gpu_uuid=UUID, size=1)
        args.update(bad)
        with pytest.raises(weightd.Error):
            _cuda.cuda_push_request(**args)


def test_send_cuda_push_fd_rides_on_the_header():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.memfd_create("x")
    try:
        _cuda.send_cuda_push(a, 5, bytes(16), [fd], UUID, 1 << 21, [0, 512])
        data, fds, _, _ = socket.recv_fds(b, 32, 4)
        assert len(data) == 32 and len(fds) == 1
        assert os.path.samestat(os.fstat(fds[0]), os.fstat(fd))
        os.close(fds[0])
        rest = b""
        while len(rest) < 96 + 16:
            rest += b.recv(4096)
        d = _decode_by_hand(data + rest)
        assert (d["magic"], d["num_offsets"], d["size"], d["offsets"]) == \
            (b"WDC1", 2, 1 << 21, [0, 512])
    finally:
        os.close(fd)
        a.close()
        b.close()


# ---------------------------------------------------------------- real daemon


def _checkpoint():
    g = torch.Generator().manual_seed(99)
    return {"w": torch.randn(37, 19, generator=g),
            "h": torch.randn(10, 6, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(0.5), "empty": torch.zeros(0, 4),
            "ids": torch.arange(13, dtype=torch.int64)}


H, R, ALPHA = 64, 8, 16
LORA_TARGETS = ["model.layers.%d.self_attn.%s.weight" % (i, m) for i in range(2)
                for m in ("q_proj", "v_proj")]


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    d.start()
    try:
        path = os.path.join(d.model_root, "small.safetensors")
        st_io.save(_checkpoint(), path)
        d.ctl_ok("load", "small", path)
        # A Llama-shaped BF16 model with a PEFT adapter on q/v (refresh).
        g = torch.Generator().manual_seed(31)
        ck = {"model.embed_tokens.weight": torch.randn(32, H, generator=g)}
        for i in range(2):
            for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
                ck["model.layers.%d.self_attn.%s.weight" % (i, m)] = \
                    torch.randn(H, H, generator=g) * 0.05
        path = os.path.join(d.model_root, "lora.safetensors")
        st_io.save({k: v.to(torch.bfloat16) for k, v in ck.items()}, path)
        d.ctl_ok("load", "lora", path)
        ad = os.path.join(d.model_root, "adapter_a")
        os.makedirs(ad)
        tensors = {}
        for t in LORA_TARGETS:
            m = t[:-len(".weight")]
            tensors["base_model.model.%s.lora_A.weight" % m] = torch.randn(R, H, generator=g) * 0.2
            tensors["base_model.model.%s.lora_B.weight" % m] = torch.randn(H, R, generator=g) * 0.2
        with open(os.path.join(ad, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA,
                       "target_modules": ["q_proj", "v_proj"]}, f)
        st_io.save(tensors, os.path.join(ad, "adapter_model.safetensors"))
        d.ctl_ok("adapter", "load", "a", ad)
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    c = weightd.Client(socket=daemon.socket, retry_deadline=0)
    yield c
    c.close()


def _grant(client, world=2, rank=0):
    resp = client._shards.Fetch(pb.FetchRequest(model="small", mesh_shape=[world], coord=[rank],
                                                transport=pb.SHM), timeout=30)
    return resp, [t.length for t in resp.tensors]


def _memfd(size):
    fd = os.memfd_create("stand-in", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if size:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    import fcntl
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _connect(resp):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(30)
    sock.connect(resp.data_socket)
    return sock


def _reply(sock):
    code, msg, fds = _datasock.read_reply(sock)
    for fd in fds:
        os.close(fd)
    assert not fds
    return code, msg


def _good_host_push(client, sock, resp, lengths):
    """A host push of the same lease on `sock`: OK, and the bytes are the
    shm fetch's."""
    offsets, size = _datasock.default_layout(lengths)
    fd = _memfd(size)
    try:
        _datasock.send_push(sock, resp.lease_id, bytes(resp.token), [fd])
        code, msg = _reply(sock)
        assert code == OK, msg
        with client.fetch("small", world=2, rank=0) as h:
            for i, m in enumerate(h.tensors):
                if m.length:
                    assert os.pread(fd, m.length, offsets[i]) == \
                        st_io.tensor_bytes(h[m.name]), m.name
    finally:
        os.close(fd)


def _cuda_built(client):
    return bool(client.stats().get("cuda_built"))


def test_fetch_into_a_gpu_without_cuda(daemon, client):
    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    for mode in (None, "push", "pull", "zero-copy", "export"):
        for device in ("cuda:0", 0, "cuda", torch.device("cuda", 0)):
            with pytest.raises(weightd.Error) as e:
                client.fetch("small", device=device, mode=mode)
            assert e.value.code == "FAILED_PRECONDITION", (mode, device, e.value)
            assert "no CUDA device in this process" in e.value.message, e.value
    assert _leases(client) == base  # refused before any lease
    assert client.health() is True


def test_fetch_device_argument_errors(daemon, client):
    cases = [(dict(device="cuda:0", transport="grpc"), "INVALID_ARGUMENT", "transport"),
             (dict(device="cuda:0", mode="pull", transport="grpc"), "INVALID_ARGUMENT",
              "transport"),
             (dict(device="cuda:0", mode="export", transport="grpc"), "INVALID_ARGUMENT",
              "transport"),
             (dict(device="cuda:0", mode="bogus"), "INVALID_ARGUMENT", "mode"),
             (dict(mode="pull"), "INVALID_ARGUMENT", "device="),
             (dict(device="cuda:x"), "INVALID_ARGUMENT", "device"),
             (dict(device="mps"), "INVALID_ARGUMENT", "device"),
             (dict(mode="push", transport="grpc"), "INVALID_ARGUMENT", "transport")]
    for kwargs, code, word in cases:
        with pytest.raises(weightd.Error) as e:
            client.fetch("small", **kwargs)
        assert e.value.code == code and word in e.value.message, (kwargs, e.value)
    # device="cpu" is host memory: today's fetch.
    with client.fetch("small", device="cpu") as h:
        assert h.device is None and h.mode == "export" and float(h["scalar"]) == 0.5
    with client.fetch("small", device="cpu", mode="push") as h:
        assert h.device is None and h.mode == "push" and h["ids"].tolist() == list(range(13))


def test_raw_cuda_push_daemon_has_no_gpu(daemon, client):
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    resp, lengths = _grant(client)
    _, size = _datasock.default_layout(lengths)
    stand_in = _memfd(2 << 20)
    sock = _connect(resp)
    try:
        _cuda.send_cuda_push(sock, resp.lease_id, bytes(resp.token), [stand_in], UUID, 2 << 20)
        code, msg = _reply(sock)
        if _cuda_built(client):
            assert code == FAILED_PRECONDITION, (code, msg)
            assert msg.startswith("the daemon has no GPU to push to %s: " % UUID_TEXT), msg
            assert client.stats().get("gpus_unavailable", "") in msg
        else:
            assert code == UNIMPLEMENTED and "without CUDA" in msg, (code, msg)
        # The connection keeps serving: a host push of the same lease on it.
        _good_host_push(client, sock, resp, lengths)
    finally:
        sock.close()
        os.close(stand_in)
    # The high-level call says the same (and keeps our fd open).
    resp, lengths = _grant(client)
    stand_in = _memfd(2 << 20)
    try:
        with pytest.raises(weightd.Error) as e:
            _cuda.push_cuda(resp.data_socket, resp.lease_id, bytes(resp.token), stand_in, UUID,
                            2 << 20, None, timeout=30)
        assert e.value.code == ("FAILED_PRECONDITION" if _cuda_built(client) else
                                "UNIMPLEMENTED"), e.value
        os.fstat(stand_in)
    finally:
        os.close(stand_in)
    assert _wait_leases(client, base) == base
    assert client.health() is True and daemon.alive()


@pytest.mark.parametrize("case", ["unknown_kind", "too_small", "legacy_with_fd", "vmm_without_fd",
                                  "two_fds", "export_with_fd", "export_with_size"])
def test_raw_cuda_push_bad_target(daemon, client, case):
    if case not in ("two_fds", "export_with_fd", "export_with_size") and not _cuda_built(client):
        pytest.skip("a daemon built without CUDA checks no target")
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    resp, lengths = _grant(client)
    _, size = _datasock.default_layout(lengths)
    assert size > 1
    fds = [_memfd(2 << 20), _memfd(2 << 20)]
    kind, n, target_size, want = {
        "unknown_kind": (4, 1, 2 << 20, "unknown CUDA handle kind 4"),
        "export_with_fd": (3, 1, 0, "an export carries no fd"),
        "export_with_size": (3, 0, 2 << 20, "an export carries no fd"),
        "too_small": (1, 1, size - 1, "layout needs %d bytes" % size),
        "legacy_with_fd": (2, 1, 2 << 20, "carries no fd"),
        "vmm_without_fd": (1, 0, 2 << 20, "carries its exported fd"),
        "two_fds": (1, 2, 2 << 20, "at most one fd"),
    }[case]
    sock = _connect(resp)
    try:
        _cuda.send_cuda_push(sock, resp.lease_id, bytes(resp.token), fds[:n], UUID, target_size,
                             handle_kind=kind)
        code, msg = _reply(sock)
        assert code == INVALID_ARGUMENT and want in msg, (case, code, msg)
        _good_host_push(client, sock, resp, lengths)
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)
    assert _wait_leases(client, base) == base
    assert client.health() is True and daemon.alive()


def test_fetch_cuda_push_through_a_fake_driver(daemon, client, fake, monkeypatch):
    """fetch(device="cuda:0") with the CUDA side faked (torch's device check,
    the UUID, the driver): the VMM allocation is made, its exported fd and
    size go to the real daemon, which refuses (no GPU here); the fetch raises
    the daemon's error and leaves no allocation, fd, context or lease."""
    monkeypatch.setattr(_cuda, "require_torch_cuda", lambda index: (torch, max(index, 0)))
    monkeypatch.setattr(_cuda, "gpu_uuid_bytes", lambda index: UUID)
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    fds = _open_fds()
    for world in (1, 2):
        with pytest.raises(weightd.Error) as e:
            client.fetch("small", world=world, rank=0, device="cuda:0", dtype="f32")
        if _cuda_built(client):
            assert e.value.code == "FAILED_PRECONDITION", e.value
            assert "the daemon has no GPU to push to %s" % UUID_TEXT in e.value.message
        else:
            assert e.value.code == "UNIMPLEMENTED", e.value
        gc.collect()
        fake.assert_clean()
        log = fake.log()
        assert "create %d" % (2 << 20) in log and "export" in log and "release" in log, log
    assert _wait_leases(client, base) == base
    assert _open_fds() == fds


# ---------------------------------------------------------------- gpu_checks.py

GPU_CHECKS = os.path.join(REPO, "tests", "gpu", "gpu_checks.py")


def _gpu_checks_module():
    spec = importlib.util.spec_from_file_location("gpu_checks_under_test", GPU_CHECKS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_checks_skips_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")
    out = tmp_path / "gc.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(BUILD, "python")
    env.pop("OUT", None)
    r = subprocess.run([sys.executable, GPU_CHECKS,
                        "--weightd", os.path.join(BUILD, "bin", "weightd"),
                        "--weightctl", os.path.join(BUILD, "bin", "weightctl"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["skipped"].startswith("no GPU: "), data
    assert data.get("weightd_import", "").startswith("ok"), data


def test_gpu_checks_helpers():
    gc_mod = _gpu_checks_module()
    # torch.chunk reference: uneven, empty and 0-dim pieces (docs/DESIGN.md §2.1).
    t = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    assert [tuple(gc_mod.chunk_ref(t, 4, r, None).shape) for r in range(4)] == \
        [(3, 3), (3, 3), (3, 3), (1, 3)]
    t = torch.arange(5.0)
    assert [tuple(gc_mod.chunk_ref(t, 4, r, None).shape) for r in range(4)] == \
        [(2,), (2,), (1,), (0,)]
    assert [tuple(gc_mod.chunk_ref(torch.zeros(0, 4), 3, r, None).shape) for r in range(3)] == \
        [(0, 4)] * 3
    s = torch.tensor(1.5)
    assert gc_mod.chunk_ref(s, 3, 2, "bf16").dtype == torch.bfloat16
    assert gc_mod.chunk_ref(s, 3, 2, "bf16").shape == ()
    # Bit equality, NaN-free data: a one-ulp change is caught.
    a = torch.randn(7, 3).to(torch.bfloat16)
    b = a.clone()
    assert gc_mod.same_bits(a, b)
    b.view(torch.int16)[2, 1] += 1
    assert not gc_mod.same_bits(a, b)
    assert gc_mod.same_bits(torch.zeros(0, 3), torch.zeros(0, 3))
    assert not gc_mod.same_bits(torch.zeros(0, 3), torch.zeros(3, 0))
    assert gc_mod.same_bits(torch.tensor(2.0), torch.tensor(2.0))
    assert not gc_mod.same_bits(torch.tensor(2.0), torch.tensor(2.0, dtype=torch.float64))
    # The LoRA tolerance of tests/parity/test_lora_parity.py.
    ref32 = torch.randn(64, 32)
    ok, detail = gc_mod.lora_close(ref32.clone(), ref32)
    assert ok, detail
    bad = ref32.clone()
    bad[0, 0] += 1e-2
    ok, detail = gc_mod.lora_close(bad, ref32)
    assert not ok, detail
    ref16 = ref32.to(torch.bfloat16)
    got = ref16.clone()
    ok, detail = gc_mod.lora_close(got, ref32)
    assert ok, detail
    got.view(torch.int16).view(-1)[:2] += 1  # 2 of 2048 = 0.1% off by one ulp: allowed
    ok, detail = gc_mod.lora_close(got, ref32)
    assert ok, detail
    got.view(torch.int16).view(-1)[:40] += 1  # ~2%: too many
    ok, detail = gc_mod.lora_close(got, ref32)
    assert not ok, detail
    # The per-check runner records failures and goes on.
    rec = gc_mod.Recorder(None, budget_s=60)
    rec.run("good", lambda: (True, "fine", {"x": 1}), limit_s=5)
    rec.run("bad", lambda: (False, "not fine", {}), limit_s=5)
    rec.run("raises", lambda: 1 / 0, limit_s=5)
    names = [(c["name"], c["ok"]) for c in rec.checks]
    assert names == [("good", True), ("bad", False), ("raises", False)], rec.checks
    assert "ZeroDivisionError" in rec.checks[2]["detail"]
    assert all(set(c) >= {"name", "ok", "detail", "seconds"} for c in rec.checks)


def test_gpu_checks_budget_skips_what_does_not_fit(tmp_path):
    """Every check finishes or is skipped by the budget: one needing more
    than is left is skipped before it starts (its fn never runs), one that
    runs gets min(its limit, what is left) as its alarm, and a check that
    reports "skipped" (ok None) is recorded so, not as a failure."""
    gc_mod = _gpu_checks_module()
    out = str(tmp_path / "gc.json")
    rec = gc_mod.Recorder(out, budget_s=30, reserve_s=10)
    ran = []
    rec.run("fits", lambda: (ran.append("fits"), (True, "ok", {}))[1], limit_s=60, need_s=5)
    rec.run("too big", lambda: (ran.append("too big"), (True, "ok", {}))[1], limit_s=60,
            need_s=25)
    rec.run("refused", lambda: (None, "no such path here", {"why": 1}), limit_s=5)
    assert ran == ["fits"]
    by = {c["name"]: c for c in rec.checks}
    assert by["fits"]["ok"] is True and by["fits"]["limit_s"] <= 20, by["fits"]
    assert by["too big"]["ok"] is None and "time budget" in by["too big"]["detail"], by
    assert by["refused"]["ok"] is None and by["refused"]["detail"] == "skipped: no such path here"
    doc = json.load(open(out))
    assert doc["summary"] == {"passed": 1, "failed": 0, "skipped": 2} and doc["ok"] is True, doc
    # the check list: each with a limit and what it needs, setup first
    plan = gc_mod.Checks.plan(type("C", (), {k: None for k in (
        "setup", "vmm", "push_parity", "pull_parity", "zero_copy", "export", "nan_parity", "lora",
        "killed", "bandwidth", "ready")})())
    assert plan[0][0] == "setup" and all(0 < need <= limit for _, _, limit, need in plan), plan
    assert {"zero-copy", "export", "nan", "killed", "bandwidth"} <= {p[0] for p in plan}


def test_gpu_checks_reads_the_daemon_log(daemon):
    """log_events parses the daemon's own text lines (server/base/log.cc):
    timestamp, level, event and fields, quoted ones unquoted."""
    gc_mod = _gpu_checks_module()
    lines = ('2025-03-04T05:06:07.250Z debug push connection=7 memory=cuda model=llama '
             'generation=1 bytes=4096 ms=125.5 status=OK\n'
             'weightd.cc:12: not an event\n'
             '2025-03-04T05:06:08.000Z warning pin_skipped model=llama reason="no GPU here"\n')
    p = os.path.join(daemon.workdir, "fake.log")
    with open(p, "w") as f:
        f.write(lines)
    evs = gc_mod.log_events(p)
    assert [e["event"] for e in evs] == ["push", "pin_skipped"], evs
    assert evs[0]["ts"] == 1741064767.25 and evs[0]["ms"] == "125.5" and evs[0]["memory"] == "cuda"
    assert evs[1]["reason"] == "no GPU here" and evs[1]["level"] == "warning"
    assert gc_mod.log_events(p, ("push",), start=len(lines.splitlines(True)[0])) == []
    # and the real daemon's own lines parse (its start-up ones at least)
    real = gc_mod.log_events(daemon.log_path)
    assert "serving" in [e["event"] for e in real], open(daemon.log_path).read()[-2000:]
    assert all(e["ts"] > 1.6e9 for e in real), real[:3]


def test_gpu_checks_judges_a_kill_by_the_daemons_push_line():
    """judge_kill: mid-push only when the daemon's push began before the
    kill and ended after it; a push that had ended (or whose reply the
    client saw) is "finished", one that began after the client died is
    "after", none at all "not-begun", and a counted push without a line to
    time it is "unproven"."""
    gc_mod = _gpu_checks_module()
    J = gc_mod.judge_kill
    line = lambda end, ms, status="OK": {"ts": end, "ms": str(ms), "status": status,  # noqa: E731
                                         "line": "push"}
    assert J(100.0, 5, 5, 6, False, [line(100.3, 500)])[0] == "mid-push"
    v, d = J(100.0, 5, 5, 5, False, [line(100.2, 400, "ABORTED: peer gone")])
    assert v == "mid-push" and "ABORTED" in d, d
    assert J(100.0, 5, 6, 6, False, [line(99.9, 300)])[0] == "finished"
    assert J(100.0, 5, 5, 5, True, [])[0] == "finished"
    assert J(100.0, 5, 6, 6, False, [])[0] == "finished"
    assert J(100.0, 5, 5, 6, False, [line(100.5, 100)])[0] == "after"
    assert J(100.0, 5, 5, 5, False, [])[0] == "not-begun"
    assert J(100.0, 5, 5, 6, False, [])[0] == "unproven"
    # the log's millisecond stamps: a push ending within 2 ms of the kill counts
    assert J(100.0, 5, 6, 6, False, [line(99.999, 50)])[0] == "mid-push"


def test_gpu_checks_kills_a_client_mid_push(tmp_path):
    """gpu_checks' "killed" check, run here on a host push (the same code;
    on the device it pushes into the GPU): a child is SIGKILLed after it
    asked for a push, until the daemon's side shows the kill landed
    mid-push - its "push" log line (debug, with the push's duration) began
    before the kill and ended after it - trying sooner or later as
    judge_kill says; the daemon then serves on with no lease left."""
    gc_mod = _gpu_checks_module()
    d = Daemon(workdir=str(tmp_path / "d"), extra_args=["--log-level", "debug"])
    d.start()
    checks = None
    try:
        path = os.path.join(d.model_root, "big.safetensors")
        st_io.save({"w": torch.randn(4096, 8192, generator=torch.Generator().manual_seed(8))},
                   path)  # 128 MiB: a push long enough to land in
        d.ctl_ok("load", "big", path)
        checks = gc_mod.Checks(None, weightd, torch, {})
        checks.sock, checks.log_path = d.socket, d.log_path
        checks.client = weightd.Client(socket=d.socket, retry_deadline=0)
        base = _leases(checks.client)
        verdict, detail, m = checks.kill_mid_push("big", "cpu", "f32", tries=8)
        assert verdict == "mid-push", (detail, m)
        last = m["attempts"][-1]
        assert len(last["push_lines"]) == 1 and "memory=host" in last["push_lines"][0], last
        assert all(a["verdict"] in ("finished", "after", "not-begun", "mid-push")
                   for a in m["attempts"]), m
        assert _wait_leases(checks.client, base) == base
        assert checks.client.health() is True and d.alive()
        checks.client.close()
    finally:
        if checks is not None:
            shutil.rmtree(checks.tmp, ignore_errors=True)
        d.stop()


def test_nan_encodings_follow_c10_here(daemon, client):
    """The NaN sweep of gpu_checks on the CPU path: the daemon's casts of
    NaNs (signs, payloads, signalling), +-Inf, -0 and subnormals from
    F32/F64/F16/BF16 to f32/bf16/f16 equal c10_cast bit for bit (our
    convention: c10's scalar conversions, BF16 NaN 0x7FC0, F16 NaN
    0x7E00|sign); torch's own vectorized .to() differs from it only in NaN
    bits where it differs at all (BF16 NaN 0xFFFF here), which nan_parity's
    loose comparison accepts and its exact one does not."""
    gc_mod = _gpu_checks_module()
    tensors = gc_mod.nan_sweep_tensors()
    path = os.path.join(daemon.model_root, "nans.safetensors")
    st_io.save(tensors, path)
    daemon.ctl_ok("load", "nans", path)
    table = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    vectorized_differs = []
    try:
        for dtype in (None, "f32", "bf16", "f16"):
            with client.fetch("nans", dtype=dtype) as h:
                for name, src in tensors.items():
                    target = src.dtype if dtype is None else table[dtype]
                    got = h[name]
                    want = gc_mod.c10_cast(src, target)
                    exact, loose, detail = gc_mod.nan_parity(got, want, src.to(target))
                    assert exact and loose, (name, dtype, detail)
                    if gc_mod.uint_bits(src.to(target)) != gc_mod.uint_bits(want):
                        vectorized_differs.append((name, target))
                        exact, loose, detail = gc_mod.nan_parity(got, src.to(target), want)
                        assert not exact and loose, (name, dtype, detail)
        assert gc_mod.nan_encodings(gc_mod.c10_cast(tensors["nan_f32"], torch.bfloat16)) == \
            ["0x7fc0"]
        assert gc_mod.nan_encodings(gc_mod.c10_cast(tensors["nan_f32"], torch.float16)) == \
            ["0x7e00", "0xfe00"]
        # a NaN turned into a number (or the reverse) fails both comparisons
        bad = gc_mod.c10_cast(tensors["nan_f32"], torch.bfloat16).clone()
        bad.view(torch.int16)[0] = 0x3F80
        exact, loose, detail = gc_mod.nan_parity(bad, gc_mod.c10_cast(tensors["nan_f32"],
                                                                       torch.bfloat16),
                                                 tensors["nan_f32"].to(torch.bfloat16))
        assert not exact and not loose and "#0" in detail, detail
    finally:
        daemon.ctl_ok("unload", "nans")
    print("torch's vectorized casts differing from c10 in NaN bits here:", vectorized_differs)


# ------------------------------------------- the device paths, with stand-ins

class _OwnedBytes:
    """Makes a ctypes array type that carries an `owner` (what torch's CUDA
    array interface path does with the object it consumed)."""
    types = {}

    @classmethod
    def at(cls, ptr, nbytes, owner):
        t = cls.types.get(nbytes)
        if t is None:
            t = cls.types[nbytes] = type("Owned%d" % nbytes, (ctypes.c_ubyte * nbytes,), {})
        arr = t.from_address(ptr)
        arr.owner = owner
        return arr


def _cpu_tensor_from_ptr(ptr, nbytes, dtype, shape, device_index, owner):
    """tensor_from_ptr with the fake driver's "device memory" (host memory):
    a CPU tensor over it that holds `owner` as torch's CAI path would."""
    raw = torch.frombuffer(_OwnedBytes.at(ptr, nbytes, owner), dtype=torch.uint8)
    assert raw.data_ptr() == ptr
    return _cuda.view_bytes(raw, 0, nbytes, dtype, shape)


@pytest.fixture
def stand_ins(fake, monkeypatch, client):
    """The CUDA-only pieces replaced: torch's device check, the UUID, the
    tensor over device memory, torch.cuda.synchronize, and the daemon's CUDA
    push — done by the real daemon as a host push of the same lease into the
    fake allocation's exported fd (a sealed memfd mapped at .ptr), after the
    request the client would send has been built and checked."""
    calls = []

    def push_cuda(path, lease_id, token, fd, gpu_uuid, size, offsets=None, timeout=30.0):
        header, rest = _cuda.cuda_push_request(lease_id, token, gpu_uuid, size, offsets)
        d = _decode_by_hand(header + rest)
        assert d["magic"] == b"WDC1" and d["gpu_uuid"] == UUID and d["handle_kind"] == 1
        assert d["num_offsets"] == len(offsets or [])
        assert os.fstat(fd).st_size == size and size % (2 << 20) == 0
        calls.append({"size": size, "offsets": list(offsets) if offsets else None})
        _datasock.push(path, lease_id, token, fd, offsets, timeout)

    monkeypatch.setattr(_cuda, "require_torch_cuda", lambda index: (torch, max(index, 0)))
    monkeypatch.setattr(_cuda, "gpu_uuid_bytes", lambda index: UUID)
    monkeypatch.setattr(_cuda, "tensor_from_ptr", _cpu_tensor_from_ptr)
    monkeypatch.setattr(_cuda, "push_cuda", push_cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return calls


def _same_bytes(a, b):
    return st_io.tensor_bytes(a) == st_io.tensor_bytes(b)


@pytest.mark.parametrize("world,rank,dtype", [(1, 0, None), (2, 1, "f32"), (3, 2, "bf16")])
def test_cuda_push_handle_with_stand_ins(daemon, client, fake, stand_ins, world, rank, dtype):
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    fds = _open_fds()
    h = client.fetch("small", world=world, rank=rank, device="cuda:0", dtype=dtype)
    assert (h.mode, h.device, h.transport) == ("push", "cuda:0", "shm")
    assert (h.read_only, h.access) == (False, None)  # this process's own memory
    alloc = h._push.alloc
    assert h._segment_ranges() == [(alloc.ptr, alloc.ptr + alloc.size)]
    assert alloc.fd == -1  # the exported fd was closed after the push
    offsets, size = _datasock.default_layout([m.length for m in h.tensors])
    assert [m.offset for m in h.tensors] == offsets and alloc.size >= size
    assert stand_ins == [{"size": alloc.size, "offsets": None}]
    with client.fetch("small", world=world, rank=rank, dtype=dtype) as ref:
        for m in h.tensors:
            if not m.length:
                continue
            got = h[m.name]
            assert got.data_ptr() == alloc.ptr + m.offset, m.name
            assert (got.dtype, tuple(got.shape)) == (ref[m.name].dtype, tuple(ref[m.name].shape))
            assert _same_bytes(got, ref[m.name]), m.name
            del got  # (a view would hold the allocation)
    with pytest.raises(weightd.Error) as e:
        h.numpy_dict()
    assert e.value.code == "FAILED_PRECONDITION" and "cuda:0" in e.value.message
    del e
    assert "push cuda:0" in repr(h)
    # A tensor kept after release() holds the allocation; the last one frees it.
    kept = h["w"] if any(m.name == "w" and m.length for m in h.tensors) else None
    del alloc
    h.release()
    assert h.released
    h.release()  # idempotent
    with pytest.raises(weightd.Error):
        h.state_dict()
    with pytest.raises(weightd.Error):
        h.refresh()
    gc.collect()
    if kept is not None:
        assert fake.counters()["live"] == 1
        assert kept.sum() == kept.sum()  # still readable
        del kept
    del h
    gc.collect()
    fake.assert_clean()
    assert _wait_leases(client, base) == base
    assert _open_fds() == fds


def _merged_alike(a, b):
    """Two merges of the same LoRA (BF16): equal but for one-ulp roundings
    of fp32 sums taken in another order, on at most 1% of the elements."""
    if a.dtype != b.dtype or a.shape != b.shape or a.dtype != torch.bfloat16:
        return False
    d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return int(d.max()) <= 1 and float((d > 0).float().mean()) <= 0.01


def test_cuda_push_refresh_with_stand_ins(daemon, client, fake, stand_ins):
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    h = client.fetch("lora", world=2, rank=1, device="cuda:0")
    try:
        alloc = h._push.alloc
        before = {m.name: h[m.name] for m in h.tensors}
        old = {name: st_io.tensor_bytes(before[name]) for name in before}
        gen = h.generation
        assert h.refresh() == []  # nothing changed yet
        client.apply("lora", ["a"])
        names = h.refresh()
        assert sorted(names) == sorted(LORA_TARGETS)
        assert h.generation > gen
        # merged by the push (merge_on_push, a GPU push's default): no digest
        assert all(m.digest == b"" for m in h.tensors if m.name in LORA_TARGETS)
        assert stand_ins[-1]["size"] == alloc.size
        assert sorted(stand_ins[-1]["offsets"]) == sorted(
            m.offset for m in h.tensors if m.name in LORA_TARGETS)
        with client.fetch("lora", world=2, rank=1) as ref:
            for m in h.tensors:
                # The push merged the targets element by element (the
                # GPU's merge, here run by the host twin): within one ulp of
                # the materializer's merge, whose BLAS order is the CPU's.
                same = _merged_alike if m.name in LORA_TARGETS else _same_bytes
                assert same(before[m.name], ref[m.name]), m.name  # views see it
                assert same(h[m.name], ref[m.name]), m.name
        for name in before:  # only the adapter's targets changed
            assert (st_io.tensor_bytes(before[name]) != old[name]) is (name in LORA_TARGETS), \
                name
    finally:
        client.apply("lora", [])
        del before
        h.release()
        del h, alloc
    gc.collect()
    fake.assert_clean()
    assert _wait_leases(client, base) == base


def _same_as_fetch(client, h, model, world, rank, dtype, names=None):
    """Every tensor of handle `h` has the dtype, shape and bytes of an shm
    fetch of the same request. Returns {name: (tensor, its bytes)} of the
    non-empty ones."""
    out = {}
    with client.fetch(model, world=world, rank=rank, dtype=dtype, names=names) as ref:
        for m in h.tensors:
            got = h[m.name]
            assert (got.dtype, tuple(got.shape)) == (ref[m.name].dtype,
                                                     tuple(ref[m.name].shape)), m.name
            assert _same_bytes(got, ref[m.name]), m.name
            if m.length:
                out[m.name] = (got, st_io.tensor_bytes(ref[m.name]))
    return out


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """torch "CUDA" allocations and device scopes on the CPU (for the pull:
    its copies are torch's own; what is checked is the client's logic)."""
    import contextlib
    real_empty = torch.empty

    def empty(*args, device=None, **kwargs):
        return real_empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())


@pytest.mark.parametrize("pin", ["pinned", "refused", "off"])
def test_pull_with_stand_ins(daemon, client, fake, stand_ins, cpu_as_cuda, pin):
    if pin == "refused":
        fake.lib.fake_attr(_cuda.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, 0)
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    fds = _open_fds()
    for world, rank, dtype in ((1, 0, None), (3, 1, "bf16"), (4, 3, "f32")):
        h = client.fetch("small", world=world, rank=rank, device="cuda:0", mode="pull",
                         dtype=dtype, pin=pin != "off")
        assert (h.mode, h.device) == ("pull", "cuda:0") and not h.released
        assert (h.read_only, h.access) == (False, None)  # torch's own copies
        assert h.pinned is (pin == "pinned"), h.pin_error
        assert (h.pin_error != "") is (pin == "refused"), h.pin_error
        assert _wait_leases(client, base) == base  # the lease ended with the fetch
        for name, (got, _) in _same_as_fetch(client, h, "small", world, rank, dtype).items():
            assert got is h[name]  # torch owns it: the same one
        h.release()
        assert h.released
    log = fake.log()
    if pin == "pinned":
        assert "host register" in log and "flags 8 aligned 1" in log, log
        assert log.count("host register") == log.count("host unregister"), log
    else:
        assert "host register" not in log, log
    gc.collect()
    fake.assert_clean()
    assert stand_ins == []  # a pull never pushes
    assert _wait_leases(client, base) == base
    assert _open_fds() == fds


def _maps_of(addresses):
    """{address: (start, end, perms, path)} of the /proc/self/maps line
    holding each address (None where none does)."""
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            rows.append((lo, hi, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return {a: next((r for r in rows if r[0] <= a < r[1]), None) for a in addresses}


def _registered_ranges(log):
    """[(start, end)] the fake driver registered (its log: "host register N
    flags F aligned A at 0xADDR"; its device address is the host one)."""
    out = []
    for line in log.splitlines():
        if line.startswith("host register "):
            words = line.split()
            out.append((int(words[-1], 16), int(words[-1], 16) + int(words[2])))
    return sorted(out)


@pytest.mark.parametrize("profile", ["gh200", "x86-h100-hmm", "read-only-register"])
def test_zero_copy_with_stand_ins(daemon, client, fake, stand_ins, cpu_as_cuda, profile):
    """mode="zero-copy": the tensors are over the shm mapping itself (the
    stand-in tensor_from_ptr reads the address it is given, so a wrong one
    shows as wrong bytes): at the host address where the device reads
    pageable memory (GH200; an x86 H100 with HMM), else at the device
    address of a read-only mapped registration of the shard's pages (the
    fake's unified addressing), unregistered — after a device sync — once
    the last tensor goes; every tensor lies inside the ranges the handle
    reports (_segment_ranges: the mapped page ranges, or exactly the ranges
    the driver registered), and those are read-only shared maps of the
    daemon's memfds; the handle says read_only; the lease ends with
    release(), the tensors stay readable."""
    fake.profile(profile)
    pageable = profile != "read-only-register"
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    fds = _open_fds()
    # (lora's last tensor alone, kept dtype: a view pages into its
    # checkpoint's segment, so the registered range starts there)
    last = ["model.layers.1.self_attn.v_proj.weight"]
    for model, world, rank, dtype, names in (
            ("small", 1, 0, None, None), ("small", 3, 1, "bf16", None),
            ("small", 4, 3, "f32", None), ("lora", 2, 1, None, last)):
        log_at = len(fake.log())
        h = client.fetch(model, world=world, rank=rank, device="cuda:0", mode="zero-copy",
                         dtype=dtype, names=names)
        assert (h.mode, h.device) == ("zero-copy", "cuda:0") and not h.released
        assert h.pageable_access is pageable
        assert (h.read_only, h.access) == (True, "read-only")
        assert _wait_leases(client, base + 1) == base + 1  # held by the handle
        ranges = h._segment_ranges()
        if not pageable:
            assert ranges == _registered_ranges(fake.log()[log_at:]), (ranges, fake.log())
        # every range is a read-only shared map of one of the daemon's memfds
        for lo, hi in ranges:
            row = _maps_of([lo])[lo]
            assert row and row[0] <= lo and hi <= row[1], (hex(lo), row)
            assert row[2] == "r--s" and row[3].startswith("/memfd:"), row
        kept = _same_as_fetch(client, h, model, world, rank, dtype, names)
        for name, (t, _) in kept.items():
            p, n = t.data_ptr(), t.numel() * t.element_size()
            assert any(lo <= p and p + n <= hi for lo, hi in ranges), (name, hex(p), ranges)
        if not pageable:
            assert fake.counters()["registered"] > 0
        h.release()
        assert h.released
        assert _wait_leases(client, base) == base  # the lease ended with release()
        for name, (t, want) in kept.items():  # the pages stay while a tensor does
            assert st_io.tensor_bytes(t) == want, name
        del kept, t, h
        gc.collect()
        assert fake.counters()["registered"] == 0
    log = fake.log()
    if not pageable:
        assert "flags 10 aligned 1" in log and "device pointer" in log, log  # READ_ONLY|DEVICEMAP
        assert log.count("host register") == log.count("host unregister"), log
        # each unregistration waits for the device's queued reads first
        assert log.count("sync") >= log.count("host unregister"), log
    else:
        assert "host register" not in log, log
    gc.collect()
    fake.assert_clean()
    assert stand_ins == []  # nothing is pushed
    assert _open_fds() == fds
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", mode="zero-copy")
    assert e.value.code == "INVALID_ARGUMENT" and "device" in e.value.message
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", device="cuda:0", mode="zero-copy", transport="grpc")
    assert e.value.code == "INVALID_ARGUMENT"


def test_zero_copy_refused_on_an_x86_h100(daemon, client, fake, stand_ins, cpu_as_cuda):
    """An x86 H100 (no pageable memory access, no read-only registration):
    zero-copy has no path there, and fetch says so at once —
    FAILED_PRECONDITION naming both attributes — before any Fetch (no
    lease, no fetch counted, nothing registered); the other modes still
    work on that device: a push, and a pull that copies unpinned (its pin
    refusal names the attribute)."""
    fake.profile("x86-h100")
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    fds = _open_fds()
    fetches = client.stats()["fetches"]
    with pytest.raises(weightd.Error) as e:
        client.fetch("small", device="cuda:0", mode="zero-copy")
    assert e.value.code == "FAILED_PRECONDITION", e.value
    for words in ("CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0",
                  "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0",
                  "CUDA device 0", 'mode="push"'):
        assert words in e.value.message, e.value.message
    del e
    assert client.stats()["fetches"] == fetches  # failed fast: no Fetch at all
    assert _leases(client) == base
    assert "host register" not in fake.log()
    gc.collect()
    fake.assert_clean()
    # the same device pushes, and pulls without pinning
    with client.fetch("small", device="cuda:0") as h:
        assert h.mode == "push" and (h.read_only, h.access) == (False, None)
        _same_as_fetch(client, h, "small", 1, 0, None)
    h = client.fetch("small", device="cuda:0", mode="pull")
    assert h.pinned is False and \
        "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0" in h.pin_error, h.pin_error
    assert (h.read_only, h.access) == (False, None)
    h.release()
    del h
    gc.collect()
    fake.assert_clean()
    assert _wait_leases(client, base) == base
    assert _open_fds() == fds


def test_torch_has_no_read_only_cuda_array_interface():
    """Why zero-copy and export tensors are not marked read-only in torch:
    torch has no read-only tensor, and its CUDA-array-interface import
    refuses the interface's read-only flag (TypeError). If this starts
    failing, torch has learned read-only tensors: _DeviceArray should pass
    the flag for read-only memory (ShardHandle.read_only)."""
    class ReadOnly:
        __cuda_array_interface__ = {"shape": (16,), "typestr": "|u1", "version": 3,
                                    "data": (0x7F0000001000, True), "strides": None}
    with pytest.raises(TypeError, match="read only flag is not supported"):
        torch.as_tensor(ReadOnly(), device="cuda:0")


# ---------------------------------------------------------------- export


def _export_fetch(client, world=2, rank=1, dtype=None, model="small"):
    """A Fetch as fetch(mode="export", device=...) sends it (casts deferred
    to the fill)."""
    from weightd import _dtypes
    dt = _dtypes.parse_request_dtype(dtype)
    return client._shards.Fetch(pb.FetchRequest(
        model=model, mesh_shape=[world], coord=[rank], transport=pb.SHM,
        dtype=_dtypes.enum_of_name(dt) if dt else pb.DTYPE_UNSPECIFIED, defer_casts=True,
        defer_merges=True), timeout=30)


def test_export_host_twin(daemon, client):
    """An export to host memory (the all-zero UUID: the host twin of the
    CUDA export): one memfd sealed against writes, the shard at the default
    layout (cast as it was filled), shared by every export of the same fetch
    table (the same file); the connection holds the lease; a GPU the daemon
    lacks is refused, and the daemon serves on."""
    import fcntl
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    fds = _open_fds()
    for world, rank, dtype in ((1, 0, None), (2, 1, "f32"), (3, 2, "bf16")):
        what = "world %d rank %d dtype %s" % (world, rank, dtype)
        resp = _export_fetch(client, world, rank, dtype)
        offsets, layout = _datasock.default_layout([t.length for t in resp.tensors])
        sock, fd, size, got_layout = _cuda.export(resp.data_socket, resp.lease_id,
                                                  bytes(resp.token), _cuda.HOST_UUID)
        try:
            assert got_layout == layout and size >= layout and size % 4096 == 0, what
            # A segment of the daemon's host memory (charged to its budget).
            assert os.readlink("/proc/self/fd/%d" % fd).startswith("/memfd:weightd:export")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            F_SEAL_FUTURE_WRITE = 0x10  # Linux 5.1; the daemon's pick from 5.10 on
            assert seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE), what
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW, what
            with pytest.raises(OSError):
                mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            data = os.pread(fd, size, 0)
            assert _leases(client) == base + 1  # held by the export's connection
            with client.fetch("small", world=world, rank=rank, dtype=dtype) as ref:
                for t, at in zip(resp.tensors, offsets):
                    assert data[at:at + t.length] == st_io.tensor_bytes(ref[t.name]), \
                        "%s: %s" % (what, t.name)
            # Another fetch of the same request (the same table): the same buffer.
            again = _export_fetch(client, world, rank, dtype)
            sock2, fd2, size2, _ = _cuda.export(again.data_socket, again.lease_id,
                                                bytes(again.token), _cuda.HOST_UUID)
            assert os.fstat(fd2).st_ino == os.fstat(fd).st_ino and size2 == size, what
            os.close(fd2)
            sock2.close()
        finally:
            os.close(fd)
            sock.close()
        assert _wait_leases(client, base) == base  # the connections' leases ended
    resp = _export_fetch(client)
    with pytest.raises(weightd.Error) as e:
        _cuda.export(resp.data_socket, resp.lease_id, bytes(resp.token), UUID)
    if _cuda_built(client):
        assert e.value.code == "FAILED_PRECONDITION" and "no GPU" in e.value.message, e.value
    else:  # (a build without CUDA, e.g. the TSan one, says so)
        assert e.value.code == "FAILED_PRECONDITION" and "built without CUDA" in e.value.message, \
            e.value
    # (attached by the refused export, the lease ended with its connection)
    assert _wait_leases(client, base) == base
    assert _open_fds() == fds
    assert client.health() is True and daemon.alive()


def test_export_budget_evicts_unheld_buffers_only(tmp_path):
    """--device-memory-bytes: a second buffer that does not fit beside a held
    one is RESOURCE_EXHAUSTED (naming the flag); once the first one's
    connection closes, the second evicts it. (One uid may hold it all here.)"""
    d = Daemon(workdir=str(tmp_path / "d"), extra_args=["--device-memory-bytes", "6000",
                                                        "--max-export-bytes-per-uid", "12000"])
    d.start()
    try:
        path = os.path.join(d.model_root, "small.safetensors")
        st_io.save(_checkpoint(), path)
        d.ctl_ok("load", "small", path)
        c = weightd.Client(socket=d.socket)
        first = _export_fetch(c, 1, 0, None)
        sock, fd, size, _ = _cuda.export(first.data_socket, first.lease_id, bytes(first.token),
                                         _cuda.HOST_UUID)
        os.close(fd)
        assert size == 4096
        second = _export_fetch(c, 1, 0, "f32")
        with pytest.raises(weightd.Error) as e:
            _cuda.export(second.data_socket, second.lease_id, bytes(second.token),
                         _cuda.HOST_UUID)
        assert e.value.code == "RESOURCE_EXHAUSTED", e.value
        assert "--device-memory-bytes" in e.value.message and "held" in e.value.message
        sock.close()  # the first buffer is no longer held
        second = _export_fetch(c, 1, 0, "f32")
        deadline = time.time() + 10
        while True:
            try:
                sock2, fd2, size2, _ = _cuda.export(second.data_socket, second.lease_id,
                                                    bytes(second.token), _cuda.HOST_UUID)
                break
            except weightd.Error as err:  # the daemon sees the close a moment later
                assert err.code == "RESOURCE_EXHAUSTED" and time.time() < deadline, err
                second = _export_fetch(c, 1, 0, "f32")
                time.sleep(0.05)
        os.close(fd2)
        sock2.close()
        assert c.health() is True
        c.close()
    finally:
        d.stop()


# Runs as another uid: exports (host twin) every table in argv[3] (a JSON
# list of [world, rank, dtype]) of model argv[2], holding each it gets; prints
# one JSON line per table, then "held", then waits for a line on stdin.
_EXPORTER = r"""
import json, sys
import weightd
from weightd import _cuda, _dtypes
from weightd.v1 import weightd_pb2 as pb
c = weightd.Client(socket=sys.argv[1], retry_deadline=0)
held = []
for world, rank, dtype in json.loads(sys.argv[3]):
    dt = _dtypes.parse_request_dtype(dtype)
    resp = c._shards.Fetch(pb.FetchRequest(
        model=sys.argv[2], mesh_shape=[world], coord=[rank], transport=pb.SHM,
        dtype=_dtypes.enum_of_name(dt) if dt else pb.DTYPE_UNSPECIFIED, defer_casts=True,
        defer_merges=True), timeout=30)
    try:
        sock, fd, size, _ = _cuda.export(resp.data_socket, resp.lease_id, bytes(resp.token),
                                         _cuda.HOST_UUID)
        held.append((sock, fd))
        print(json.dumps({"size": size}), flush=True)
    except weightd.Error as e:
        print(json.dumps({"code": e.code, "message": e.message}), flush=True)
print("held", flush=True)
sys.stdin.readline()
"""

MiB = 1 << 20


def _open_dir(path):
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o777)
    return path


class _Exporter:
    """An _EXPORTER process as `uid`, holding what it got until close()."""

    def __init__(self, d, uid, model, tables):
        env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
        self.proc = subprocess.Popen(
            user_prefix(uid) + [sys.executable, "-c", _EXPORTER, d.socket, model,
                                json.dumps(tables)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env)
        self.results = []
        while True:
            line = self.proc.stdout.readline()
            assert line, "exporter %d died: %s" % (uid, self.proc.stderr.read())
            if line.strip() == "held":
                break
            self.results.append(json.loads(line))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=20)


def _daemon_shmem(pid):
    """The daemon's memfds, each once: (count, bytes), and its RssShmem."""
    seen = {}
    for n in os.listdir("/proc/%d/fd" % pid):
        try:
            if not os.readlink("/proc/%d/fd/%s" % (pid, n)).startswith("/memfd:"):
                continue
            st = os.stat("/proc/%d/fd/%s" % (pid, n))
        except OSError:
            continue  # closed meanwhile
        seen[st.st_ino] = st.st_size
    with open("/proc/%d/status" % pid) as f:
        rss_shmem = next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssShmem:"))
    return len(seen), sum(seen.values()), rss_shmem


def test_host_exports_are_bounded_by_the_host_budget_and_a_share_per_uid():
    """Host exports (the CUDA export's host twin) are host memory charged to
    --host-memory-bytes: under a 48 MiB budget one unprivileged reader asking
    exports of 28 different fetch tables of an 8 MiB model, holding each,
    gets RESOURCE_EXHAUSTED at its share (half of the exports' budget, itself
    half of the host budget), the daemon's memfds stay within the budget and
    within what stats say is resident, root and another uid still fetch and
    export, and once the reader lets go its buffers give way to a load."""
    base = _open_dir(tempfile.mkdtemp(prefix="weightd-exports-"))
    budget = 48 * MiB
    d = Daemon(model_root=_open_dir(os.path.join(base, "models")),
               workdir=_open_dir(os.path.join(base, "d")),
               extra_args=["--host-memory-bytes", str(budget), "--socket-mode", "0666"])
    d.start()
    readers = []
    try:
        g = torch.Generator().manual_seed(5)
        model = {"w%d" % i: torch.randn(512, 512, generator=g) for i in range(8)}  # 8 MiB
        path = os.path.join(d.model_root, "m.safetensors")
        st_io.save(model, path)
        os.chmod(path, 0o644)
        d.ctl_ok("load", "m", path)
        c = weightd.Client(socket=d.socket, retry_deadline=0)
        tables = [[w, r, None] for w in range(7, 0, -1) for r in range(w)]
        assert len(tables) == 28
        reader = _Exporter(d, 4343, "m", tables)
        readers.append(reader)
        got = [r["size"] for r in reader.results if "size" in r]
        refused = [r for r in reader.results if "size" not in r]
        share = budget // 4
        assert got and sum(got) <= share, reader.results
        assert refused, "28 exports of %d bytes all granted" % sum(got)
        for r in refused:
            assert r["code"] == "RESOURCE_EXHAUSTED", r
            assert "uid 4343" in r["message"] and "--max-export-bytes-per-uid" in r["message"], r
        # What the daemon holds is within the budget and what stats say.
        memfds, shmem, rss_shmem = _daemon_shmem(d.proc.pid)
        resident = c.stats()["bytes_resident"]
        assert memfds == 1 + len(got), (memfds, got)  # the checkpoint, the reader's exports
        assert shmem <= resident <= budget, (shmem, resident)
        assert rss_shmem <= budget, rss_shmem
        assert resident >= 8 * MiB + sum(got), (resident, got)
        # Root fetches and exports; another uid exports, up to its own share.
        with c.fetch("m") as h:
            assert all(torch.equal(h[k], v) for k, v in model.items())
        resp = _export_fetch(c, 2, 1, None, model="m")
        sock, fd, size, _ = _cuda.export(resp.data_socket, resp.lease_id, bytes(resp.token),
                                         _cuda.HOST_UUID)
        try:
            assert size >= 4 * MiB
            assert os.pread(fd, 4096, 0) == st_io.tensor_bytes(model["w0"][256:])[:4096]
        finally:
            os.close(fd)
            sock.close()
        other = _Exporter(d, 4344, "m", [[2, 0, None]])
        readers.append(other)
        assert "size" in other.results[0], other.results
        assert c.stats()["bytes_resident"] <= budget
        # All let go: the kept buffers give way to a load that needs their room.
        for r in readers:
            r.close()
        big = {"b%d" % i: torch.randn(1024, 1024, generator=g) for i in range(7)}  # 28 MiB
        path = os.path.join(d.model_root, "big.safetensors")
        st_io.save(big, path)
        deadline = time.time() + 10
        while True:  # the daemon sees the readers' connections close a moment later
            r = d.ctl("load", "big", path)
            if r.returncode == 0:
                break
            assert r.error_code == "RESOURCE_EXHAUSTED" and time.time() < deadline, r.stderr
            time.sleep(0.1)
        memfds, shmem, _ = _daemon_shmem(d.proc.pid)
        assert shmem <= c.stats()["bytes_resident"] <= budget
        assert c.health() is True and d.alive()
        c.close()
    finally:
        for r in readers:
            r.close()
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("access", ["read-only", "refused"])
def test_cuda_export_with_stand_ins(daemon, client, fake, stand_ins, cpu_as_cuda, monkeypatch,
                                    access):
    """fetch(device="cuda:0", mode="export") with the CUDA side faked: the
    daemon's buffer is its host twin (the export asked of the real daemon
    with the all-zero UUID: it has no GPU), imported through the fake driver
    read-only (cuMemImportFromShareableHandle, map, PROT_READ access) and
    wrapped as tensors; they equal an shm fetch, every one inside the
    imported range, which is a read-only map (the fake maps "device"
    memory in this process); the handle says read_only and which access the
    driver took: a driver refusing PROT_READ gets read-write, recorded
    (access "read-write", access_error its refusal) and visible in the map;
    release() ends the lease, the import is released when the last tensor
    goes."""
    real_export = _cuda.export
    asked = []

    def export(path, lease_id, token, gpu_uuid, timeout=30.0):
        asked.append(gpu_uuid)
        sock, fd, size, layout = real_export(path, lease_id, token, _cuda.HOST_UUID, timeout)
        if access == "refused":
            # The host twin is sealed against writes (no writable map of it
            # can exist): device memory the driver maps read-write is an
            # unsealed copy of its bytes here.
            copy = _memfd(size)
            os.pwrite(copy, os.pread(fd, size, 0), 0)
            os.close(fd)
            fd = copy
        return sock, fd, size, layout
    monkeypatch.setattr(_cuda, "export", export)
    base = _wait_leases(client, 0, timeout=5.0)  # earlier tests' leases have ended
    fds = _open_fds()
    for world, rank, dtype in ((1, 0, None), (3, 1, "bf16"), (2, 1, "f32")):
        if access == "refused":
            fake.fail("cuMemSetAccess", 801)  # the first (read-only) one
        h = client.fetch("small", world=world, rank=rank, device="cuda:0", mode="export",
                         dtype=dtype)
        assert (h.mode, h.device) == ("export", "cuda:0") and not h.released
        assert asked[-1] == UUID
        assert _leases(client) == base + 1
        assert h.read_only is True
        if access == "refused":
            assert h.access == "read-write", h.access
            assert "cuMemSetAccess (read-only)" in h.access_error and "(801)" in h.access_error
        else:
            assert (h.access, h.access_error) == ("read-only", "")
        [(lo, hi)] = h._segment_ranges()
        row = _maps_of([lo])[lo]
        assert row and (row[0], row[1]) == (lo, hi), (hex(lo), hex(hi), row)
        assert row[2] == ("rw-s" if access == "refused" else "r--s"), row
        kept = _same_as_fetch(client, h, "small", world, rank, dtype)
        for name, (t, _) in kept.items():
            p, n = t.data_ptr(), t.numel() * t.element_size()
            assert lo <= p and p + n <= hi, name
        del kept, t
        h.release()
        assert h.released
        assert _wait_leases(client, base) == base
        del h
        gc.collect()
    log = fake.log()
    if access == "refused":  # read-only refused, then read-write
        assert "import" in log and "cuMemSetAccess failed 801\naccess loc=1/0 flags=3 count=1" \
            in log, log
    else:
        assert "import" in log and "access loc=1/0 flags=1 count=1" in log, log  # read-only
    fake.assert_clean()
    assert stand_ins == []  # nothing is pushed
    assert _open_fds() == fds
