/* A fake CUDA driver (libcuda.so.1) for testing vLLM's cumem allocator extension
 * on a machine without a GPU.
 *
 * It implements only the driver calls csrc/cumem_allocator.cpp makes, keeps the
 * state a real driver would check (live physical handles, reserved VA ranges,
 * mappings) and never touches memory at the fake addresses it hands out.
 * Control functions, prefixed stub_, let a test make the next call of a given
 * function fail and read the counts back.
 *
 * Build: cc -shared -fPIC -I$CUDA_HOME/include -Wl,-soname,libcuda.so.1
 *        fake_libcuda.c -o libcuda.so.1
 */
#include <cuda.h>
#include <stdint.h>
#include <string.h>

#define MAX_OBJECTS 4096
#define MAX_FAILS 16
#define GRANULARITY (2ull << 20)

typedef struct {
  CUdeviceptr base;
  size_t size;
  int live;
} range_t;

typedef struct {
  CUdeviceptr addr;
  size_t size;
  CUmemGenericAllocationHandle handle;
  int live;
} mapping_t;

typedef struct {
  char fn[64];
  CUresult code;
  int armed;
} fail_t;

static unsigned char handle_live[MAX_OBJECTS];
static CUmemGenericAllocationHandle next_handle = 1;
static range_t reservations[MAX_OBJECTS];
static mapping_t mappings[MAX_OBJECTS];
static CUdeviceptr next_va = 0x100000000000ull;
static fail_t fails[MAX_FAILS];
static CUcontext current_ctx = NULL;
static int primary_ctx;
static int fabric_advertised, fabric_refused; /* stub_fabric */
static int creates_fabric, creates_posix_fd, creates_other;

/* ---- control -------------------------------------------------------------- */

/* Make the next call of `fn` return `code`, without doing anything. */
int stub_fail_next(const char* fn, int code) {
  for (int i = 0; i < MAX_FAILS; ++i) {
    if (!fails[i].armed) {
      strncpy(fails[i].fn, fn, sizeof(fails[i].fn) - 1);
      fails[i].fn[sizeof(fails[i].fn) - 1] = '\0';
      fails[i].code = (CUresult)code;
      fails[i].armed = 1;
      return 0;
    }
  }
  return -1;
}

/* The card advertises fabric handles; `refuse`: cuMemCreate refuses them
 * (CUDA_ERROR_NOT_PERMITTED, as on a node without an IMEX channel). */
void stub_fabric(int advertise, int refuse) {
  fabric_advertised = advertise;
  fabric_refused = refuse;
}

/* cuMemCreate calls so far by the handle type asked for (refused ones too):
 * 0 fabric, 1 POSIX file descriptor, 2 any other. */
int stub_creates(int kind) {
  return kind == 0 ? creates_fabric : kind == 1 ? creates_posix_fd : creates_other;
}

int stub_live_handles(void) {
  int n = 0;
  for (int i = 0; i < MAX_OBJECTS; ++i) n += handle_live[i];
  return n;
}

int stub_live_mappings(void) {
  int n = 0;
  for (int i = 0; i < MAX_OBJECTS; ++i) n += mappings[i].live;
  return n;
}

int stub_live_reservations(void) {
  int n = 0;
  for (int i = 0; i < MAX_OBJECTS; ++i) n += reservations[i].live;
  return n;
}

static int injected(const char* fn, CUresult* code) {
  for (int i = 0; i < MAX_FAILS; ++i) {
    if (fails[i].armed && strcmp(fails[i].fn, fn) == 0) {
      fails[i].armed = 0;
      *code = fails[i].code;
      return 1;
    }
  }
  return 0;
}

#define INJECT(fn)                   \
  do {                               \
    CUresult injected_code;          \
    if (injected(fn, &injected_code)) \
      return injected_code;          \
  } while (0)

/* ---- driver API ------------------------------------------------------------ */

CUresult cuGetErrorString(CUresult error, const char** pStr) {
  switch ((int)error) {
    case 0: *pStr = "no error"; break;
    case 1: *pStr = "invalid argument"; break;
    case 2: *pStr = "out of memory"; break;
    case 201: *pStr = "invalid device context"; break;
    case 700: *pStr = "an illegal memory access was encountered"; break;
    case 801: *pStr = "operation not supported"; break;
    default: *pStr = "unknown error"; break;
  }
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* pctx) {
  INJECT("cuCtxGetCurrent");
  *pctx = current_ctx;
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  INJECT("cuCtxSetCurrent");
  current_ctx = ctx;
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  INJECT("cuDevicePrimaryCtxRetain");
  (void)dev;
  *pctx = (CUcontext)&primary_ctx;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  INJECT("cuDeviceGetAttribute");
  (void)dev;
  /* no GPUDirect RDMA; fabric handles where stub_fabric says so */
  *pi = attrib == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED ? fabric_advertised : 0;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t* granularity,
                                       const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  INJECT("cuMemGetAllocationGranularity");
  (void)prop;
  (void)option;
  *granularity = GRANULARITY;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment,
                             CUdeviceptr addr, unsigned long long flags) {
  INJECT("cuMemAddressReserve");
  (void)alignment;
  (void)addr;
  (void)flags;
  if (size == 0 || size % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < MAX_OBJECTS; ++i) {
    if (!reservations[i].live) {
      reservations[i].base = next_va;
      reservations[i].size = size;
      reservations[i].live = 1;
      *ptr = next_va;
      next_va += size + GRANULARITY; /* leave a gap between ranges */
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  INJECT("cuMemAddressFree");
  for (int i = 0; i < MAX_OBJECTS; ++i) {
    if (reservations[i].live && reservations[i].base == ptr &&
        reservations[i].size == size) {
      reservations[i].live = 0;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long flags) {
  INJECT("cuMemCreate");
  (void)flags;
  if (prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_FABRIC) {
    ++creates_fabric;
    if (fabric_refused) return CUDA_ERROR_NOT_PERMITTED;
  } else if (prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    ++creates_posix_fd;
  } else {
    ++creates_other;
  }
  if (size == 0 || size % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
  if (next_handle >= MAX_OBJECTS) return CUDA_ERROR_OUT_OF_MEMORY;
  handle_live[next_handle] = 1;
  *handle = next_handle++;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  INJECT("cuMemRelease");
  if (handle == 0 || handle >= MAX_OBJECTS || !handle_live[handle])
    return CUDA_ERROR_INVALID_VALUE;
  handle_live[handle] = 0;
  return CUDA_SUCCESS;
}

static int inside_reservation(CUdeviceptr ptr, size_t size) {
  for (int i = 0; i < MAX_OBJECTS; ++i) {
    if (reservations[i].live && ptr >= reservations[i].base &&
        ptr + size <= reservations[i].base + reservations[i].size)
      return 1;
  }
  return 0;
}

static int overlaps_mapping(CUdeviceptr ptr, size_t size) {
  for (int i = 0; i < MAX_OBJECTS; ++i) {
    if (mappings[i].live && ptr < mappings[i].addr + mappings[i].size &&
        mappings[i].addr < ptr + size)
      return 1;
  }
  return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                  CUmemGenericAllocationHandle handle, unsigned long long flags) {
  INJECT("cuMemMap");
  (void)flags;
  if (offset != 0 || handle == 0 || handle >= MAX_OBJECTS || !handle_live[handle])
    return CUDA_ERROR_INVALID_VALUE;
  /* like the driver: an address that is already mapped is an invalid argument */
  if (!inside_reservation(ptr, size) || overlaps_mapping(ptr, size))
    return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < MAX_OBJECTS; ++i) {
    if (!mappings[i].live) {
      mappings[i].addr = ptr;
      mappings[i].size = size;
      mappings[i].handle = handle;
      mappings[i].live = 1;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  INJECT("cuMemUnmap");
  for (int i = 0; i < MAX_OBJECTS; ++i) {
    if (mappings[i].live && mappings[i].addr == ptr && mappings[i].size == size) {
      mappings[i].live = 0;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                        size_t count) {
  INJECT("cuMemSetAccess");
  if (desc == NULL || count == 0) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < MAX_OBJECTS; ++i) {
    if (mappings[i].live && mappings[i].addr == ptr && mappings[i].size == size)
      return CUDA_SUCCESS;
  }
  return CUDA_ERROR_INVALID_VALUE;
}
