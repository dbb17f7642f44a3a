/* NVML entry points answered from the loaded profile. Signatures come from nvml.h (the compiler checks every
 * definition against the official prototype). Every entry point takes g_mock_lock for its whole body. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "mocknvml.h"
#include "state.h"

mock_state g_mock;
pthread_mutex_t g_mock_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---------------------------------------------------------------------------------------------------------
 * Handles: pointers into static tables that outlive shutdown/init, so a stale handle is detected, never
 * dereferenced as freed memory.
 */
struct nvmlDevice_st { int unused; };
struct nvmlGpuInstance_st { int unused; };
struct nvmlComputeInstance_st { int unused; };

static struct nvmlDevice_st h_gpu[MOCK_MAX_GPUS];
static struct nvmlDevice_st h_mig[MOCK_MAX_GPUS][MOCK_MAX_GI][MOCK_MAX_CI];
static struct nvmlGpuInstance_st h_gi[MOCK_MAX_GPUS][MOCK_MAX_GI];
static struct nvmlComputeInstance_st h_ci[MOCK_MAX_GPUS][MOCK_MAX_GI][MOCK_MAX_CI];

nvmlDevice_t mock_gpu_handle(unsigned gpu) { return &h_gpu[gpu]; }
static nvmlDevice_t mig_handle(unsigned gpu, unsigned gi, unsigned ci) { return &h_mig[gpu][gi][ci]; }
nvmlDevice_t mock_mig_handle(unsigned gpu, unsigned gi, unsigned ci) { return mig_handle(gpu, gi, ci); }

#define IN_TABLE(p, tab) ((const char *)(p) >= (const char *)(tab) && (const char *)(p) < (const char *)(tab) + sizeof(tab))

static nvmlReturn_t resolve_dev(nvmlDevice_t h, dev_ref *r) {
    memset(r, 0, sizeof *r);
    if (IN_TABLE(h, h_gpu)) {
        size_t i = (size_t)(h - &h_gpu[0]);
        if (i >= g_mock.ngpus) return NVML_ERROR_INVALID_ARGUMENT;
        r->index = (unsigned)i;
        r->g = &g_mock.gpus[i];
        return NVML_SUCCESS;
    }
    if (IN_TABLE(h, h_mig)) {
        size_t off = (size_t)(h - &h_mig[0][0][0]);
        unsigned gpu = (unsigned)(off / (MOCK_MAX_GI * MOCK_MAX_CI));
        unsigned gi = (unsigned)(off / MOCK_MAX_CI % MOCK_MAX_GI), ci = (unsigned)(off % MOCK_MAX_CI);
        if (gpu >= g_mock.ngpus) return NVML_ERROR_INVALID_ARGUMENT;
        mock_gpu *g = &g_mock.gpus[gpu];
        if (g->v.migCurrent != 1 || !g->gi[gi].exists || !g->gi[gi].ci[ci].exists) return NVML_ERROR_INVALID_ARGUMENT;
        r->index = gpu;
        r->g = g;
        r->mig = 1;
        r->gi = &g->gi[gi];
        r->ci = &g->gi[gi].ci[ci];
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

static int listed(char (*list)[64], unsigned n, const char *fn) {
    for (unsigned k = 0; k < n; k++)
        if (strcmp(list[k], fn) == 0) return 1;
    return 0;
}

static nvmlReturn_t enter_dev(const char *fn, nvmlDevice_t h, dev_ref *r, int allow_mig) {
    if (mock_unusable(&g_mock)) return (nvmlReturn_t)mock_unusable(&g_mock);
    nvmlReturn_t e = resolve_dev(h, r);
    if (e != NVML_SUCCESS) return e;
    if (r->g->v.lost) return NVML_ERROR_GPU_IS_LOST;
    if (listed(g_mock.notSupported, g_mock.nNotSupported, fn) || listed(r->g->notSupported, r->g->nNotSupported, fn))
        return NVML_ERROR_NOT_SUPPORTED;
    if (r->mig && !allow_mig) return NVML_ERROR_NOT_SUPPORTED;
    return (nvmlReturn_t)mock_fault_locked(&g_mock, fn, (int)r->index);
}

nvmlReturn_t mock_enter_dev(const char *fn, nvmlDevice_t h, dev_ref *r, int allow_mig) {
    return enter_dev(fn, h, r, allow_mig);
}

#define LOCK() do { pthread_mutex_lock(&g_mock_lock); mock_poll_control_locked(&g_mock); mock_mig_poll_locked(&g_mock); } while (0)
#define RET(x) do { nvmlReturn_t r_ = (x); pthread_mutex_unlock(&g_mock_lock); return r_; } while (0)
#define DEV_ENTER(h, ref, allow_mig)                                                                          \
    dev_ref ref;                                                                                              \
    LOCK();                                                                                                   \
    do { nvmlReturn_t e_ = enter_dev(__func__, (h), &ref, (allow_mig)); if (e_ != NVML_SUCCESS) RET(e_); } while (0)
#define SYS_ENTER()                                                                                           \
    LOCK();                                                                                                   \
    do {                                                                                                      \
        if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));                              \
        if (listed(g_mock.notSupported, g_mock.nNotSupported, __func__)) RET(NVML_ERROR_NOT_SUPPORTED);       \
    } while (0)
#define NEED(v) do { if ((long long)(v) == MOCK_ABSENT) RET(NVML_ERROR_NOT_SUPPORTED); } while (0)

static nvmlReturn_t put_str(char *dst, unsigned length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (n + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * Init / shutdown / errors
 */
static long long now_monotonic_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

/* The driver version this copy of the library belongs to, from its file name as the driver installs it
 * (``libnvidia-ml.so.<version>``, reached through the ``libnvidia-ml.so.1`` link); "" when the name carries none
 * (the bundled ``libnvidia-ml.so.1``). Each copy a process maps answers for its own file. */
static void own_version(char *out, size_t outlen) {
    Dl_info info;
    char real[PATH_MAX];
    out[0] = '\0';
    if (!dladdr((void *)&own_version, &info) || !info.dli_fname || !realpath(info.dli_fname, real)) return;
    const char *base = strrchr(real, '/');
    base = base ? base + 1 : real;
    static const char prefix[] = "libnvidia-ml.so.";
    if (strncmp(base, prefix, sizeof prefix - 1) != 0 || !strchr(base + sizeof prefix - 1, '.')) return;
    snprintf(out, outlen, "%s", base + sizeof prefix - 1);
}

/* DRADRIVER_MOCK_NVML_SYSFS (README "GPUs the nvidia driver holds"): keep only the profile GPUs whose
 * <root>/bus/pci/devices/<dddd:bb:dd.f>/driver link ends in /nvidia, as NVML lists only what the nvidia driver
 * has bound; a GPU without a function directory there stays listed. The kept GPUs keep their order, UUID and
 * minor number; their NVML indices close up. */
static void keep_nvidia_bound(mock_state *st) {
    const char *root = getenv(MOCK_SYSFS_ENV);
    if (!root || !*root) return;
    unsigned kept = 0;
    for (unsigned k = 0; k < st->ngpus; k++) {
        const mock_gpu *g = &st->gpus[k];
        char dir[PATH_MAX], link[PATH_MAX + 16], target[PATH_MAX];
        snprintf(dir, sizeof dir, "%s/bus/pci/devices/%04x:%02x:%02x.0", root, g->domain, g->bus, g->device);
        struct stat sb;
        int keep = 1;
        if (stat(dir, &sb) == 0) {
            snprintf(link, sizeof link, "%s/driver", dir);
            ssize_t n = readlink(link, target, sizeof target - 1);
            if (n < 0) {
                keep = 0; /* unbound */
            } else {
                target[n] = '\0';
                const char *base = strrchr(target, '/');
                keep = strcmp(base ? base + 1 : target, "nvidia") == 0;
            }
        }
        if (keep) {
            if (kept != k) memcpy(&st->gpus[kept], &st->gpus[k], sizeof st->gpus[k]);
            kept++;
        }
    }
    st->ngpus = kept;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_mock_lock);
    if (g_mock.refcount > 0) {
        g_mock.refcount++;
        RET(NVML_SUCCESS);
    }
    char msg[1024];
    if (!mock_load_profile(&g_mock, msg, sizeof msg)) {
        fprintf(stderr, "mocknvml: %s\n", msg);
        fflush(stderr);
        RET(NVML_ERROR_UNKNOWN);
    }
    if (g_mock.initReturn != 0) {
        nvmlReturn_t r = (nvmlReturn_t)g_mock.initReturn;
        g_mock.ngpus = 0;
        RET(r);
    }
    char mine[sizeof g_mock.driverVersion];
    own_version(mine, sizeof mine);
    if (mine[0] && strcmp(mine, g_mock.driverVersion) != 0) { /* a library left from another driver version */
        g_mock.ngpus = 0;
        RET(NVML_ERROR_LIB_RM_VERSION_MISMATCH);
    }
    keep_nvidia_bound(&g_mock);
    const char *ctl = getenv(MOCK_CONTROL_ENV);
    snprintf(g_mock.controlPath, sizeof g_mock.controlPath, "%s", ctl ? ctl : "");
    g_mock.controlOffset = 0;
    g_mock.initMonotonicUs = now_monotonic_us();
    mock_events_reset_locked();
    g_mock.refcount = 1;
    g_mock.nFaults = 0;
    g_mock.driverGone = 0; /* the control file's "driver" lines, replayed now, say whether it is loaded */
    mock_mig_init_locked(&g_mock);
    mock_poll_control_locked(&g_mock);
    if (g_mock.driverGone) { /* unloaded on this node: init fails as nvmlInit does without the kernel module */
        g_mock.refcount = 0;
        RET(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_mock_lock);
    if (g_mock.refcount == 0) RET(NVML_ERROR_UNINITIALIZED);
    g_mock.refcount--;
    RET(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * System
 */
nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    SYS_ENTER();
    RET(put_str(version, length, g_mock.driverVersion));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    SYS_ENTER();
    RET(put_str(version, length, g_mock.nvmlVersion));
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    SYS_ENTER();
    if (!cudaDriverVersion) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(g_mock.cudaDriverVersion);
    *cudaDriverVersion = (int)g_mock.cudaDriverVersion;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    SYS_ENTER();
    if (!cudaDriverVersion) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(g_mock.cudaDriverVersion);
    *cudaDriverVersion = (int)g_mock.cudaDriverVersion;
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * Enumeration
 */
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    SYS_ENTER();
    if (!deviceCount) RET(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = g_mock.ngpus;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    SYS_ENTER();
    if (!device || index >= g_mock.ngpus) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (g_mock.gpus[index].v.lost) RET(NVML_ERROR_GPU_IS_LOST);
    *device = mock_gpu_handle(index);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    SYS_ENTER();
    if (!uuid || !device) RET(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned i = 0; i < g_mock.ngpus; i++) {
        mock_gpu *g = &g_mock.gpus[i];
        if (strcmp(g->uuid, uuid) == 0) {
            if (g->v.lost) RET(NVML_ERROR_GPU_IS_LOST);
            *device = mock_gpu_handle(i);
            RET(NVML_SUCCESS);
        }
        for (unsigned m = 0; g->v.migCurrent == 1 && m < g->nmig; m++) {
            mock_ci *ci = &g->gi[g->migGi[m]].ci[g->migCi[m]];
            if (strcmp(ci->uuid, uuid) == 0) {
                if (g->v.lost) RET(NVML_ERROR_GPU_IS_LOST);
                *device = mig_handle(i, g->migGi[m], g->migCi[m]);
                RET(NVML_SUCCESS);
            }
        }
    }
    RET(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *device) {
    SYS_ENTER();
    if (!serial || !device) RET(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned i = 0; i < g_mock.ngpus; i++) {
        if (g_mock.gpus[i].serial[0] && strcmp(g_mock.gpus[i].serial, serial) == 0) {
            if (g_mock.gpus[i].v.lost) RET(NVML_ERROR_GPU_IS_LOST);
            *device = mock_gpu_handle(i);
            RET(NVML_SUCCESS);
        }
    }
    RET(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    SYS_ENTER();
    unsigned d, b, dv;
    if (!pciBusId || !device) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!mock_parse_bus_id(pciBusId, &d, &b, &dv)) RET(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned i = 0; i < g_mock.ngpus; i++) {
        mock_gpu *g = &g_mock.gpus[i];
        if (g->domain == d && g->bus == b && g->device == dv) {
            if (g->v.lost) RET(NVML_ERROR_GPU_IS_LOST);
            *device = mock_gpu_handle(i);
            RET(NVML_SUCCESS);
        }
    }
    RET(NVML_ERROR_NOT_FOUND);
}

/* ---------------------------------------------------------------------------------------------------------
 * Identity
 */
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEV_ENTER(device, r, 1);
    RET(put_str(name, length, r.mig ? r.ci->name : r.g->name));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEV_ENTER(device, r, 1);
    RET(put_str(uuid, length, r.mig ? r.ci->uuid : r.g->uuid));
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    DEV_ENTER(device, r, 0);
    if (!r.g->serial[0]) RET(NVML_ERROR_NOT_SUPPORTED);
    RET(put_str(serial, length, r.g->serial));
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type) {
    DEV_ENTER(device, r, 1);
    if (!type) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.brand);
    *type = (nvmlBrandType_t)r.g->v.brand;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch) {
    DEV_ENTER(device, r, 1);
    if (!arch) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.architecture);
    *arch = (nvmlDeviceArchitecture_t)r.g->v.architecture;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    DEV_ENTER(device, r, 1);
    if (!major || !minor) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.ccMajor);
    *major = (int)r.g->v.ccMajor;
    *minor = r.g->v.ccMinor == MOCK_ABSENT ? 0 : (int)r.g->v.ccMinor;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    DEV_ENTER(device, r, 0);
    if (!minorNumber) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.minorNumber);
    *minorNumber = (unsigned)r.g->v.minorNumber;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEV_ENTER(device, r, 0);
    if (!index) RET(NVML_ERROR_INVALID_ARGUMENT);
    *index = r.index;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetBoardId(nvmlDevice_t device, unsigned int *boardId) {
    DEV_ENTER(device, r, 0);
    if (!boardId) RET(NVML_ERROR_INVALID_ARGUMENT);
    *boardId = (unsigned)r.g->v.boardId;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    DEV_ENTER(device, r, 0);
    if (!node) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.numaNode);
    *node = (unsigned)r.g->v.numaNode;
    RET(NVML_SUCCESS);
}

/* nvmlGpuVirtualizationMode_t: 0 none, 1 pass-through, 2 vGPU guest, 3 host vGPU, 4 host vSGA. A board value:
 * MIG handles get NOT_SUPPORTED. Dynamic MIG is refused on a vGPU guest (NVIDIA's isDynamicMIGCapable). */
nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, nvmlGpuVirtualizationMode_t *mode) {
    DEV_ENTER(device, r, 0);
    if (!mode) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.virtualizationMode);
    *mode = (nvmlGpuVirtualizationMode_t)r.g->v.virtualizationMode;
    RET(NVML_SUCCESS);
}

/* nvml.h nvmlDeviceGetModuleId: the GPU's module (baseboard slot) ID, the "physicalId" Fabric Manager names the GPU
 * by (nv_fm_types.h fmFabricPartitionGpuInfo_t: "same value as GPU Module ID"). A board value: MIG handles and
 * GPUs whose profile has no "moduleId" get NOT_SUPPORTED. */
nvmlReturn_t nvmlDeviceGetModuleId(nvmlDevice_t device, unsigned int *moduleId) {
    DEV_ENTER(device, r, 0);
    if (!moduleId) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.moduleId);
    *moduleId = (unsigned)r.g->v.moduleId;
    RET(NVML_SUCCESS);
}

/* nvml.h: versioned struct nvmlDeviceAddressingMode_v1_t; value is an nvmlDeviceAddressingModeType_t (0 None,
 * 1 HMM, 2 ATS). A board value, so MIG handles get NOT_SUPPORTED (real NVML's answer there is unconfirmed). */
nvmlReturn_t nvmlDeviceGetAddressingMode(nvmlDevice_t device, nvmlDeviceAddressingMode_t *mode) {
    DEV_ENTER(device, r, 0);
    if (!mode) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (mode->version != nvmlDeviceAddressingMode_v1) RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    NEED(r.g->v.addressingMode);
    mode->value = (unsigned)r.g->v.addressingMode;
    RET(NVML_SUCCESS);
}

void mock_fill_pci(const mock_gpu *g, nvmlPciInfo_t *pci, int full) {
    memset(pci, 0, full ? sizeof *pci : offsetof(nvmlPciInfo_t, busId));
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", g->busIdLegacy);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->device;
    pci->pciDeviceId = g->v.pciDeviceId == MOCK_ABSENT ? 0 : (unsigned)g->v.pciDeviceId;
    pci->pciSubSystemId = g->v.pciSubSystemId == MOCK_ABSENT ? 0 : (unsigned)g->v.pciSubSystemId;
    if (full) snprintf(pci->busId, sizeof pci->busId, "%s", g->busId);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEV_ENTER(device, r, 1);
    if (!pci) RET(NVML_ERROR_INVALID_ARGUMENT);
    mock_fill_pci(r.g, pci, 1);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen) {
    DEV_ENTER(device, r, 0);
    if (!maxLinkGen) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.pcieMaxGen);
    *maxLinkGen = (unsigned)r.g->v.pcieMaxGen;
    RET(NVML_SUCCESS);
}

/* nvmlDeviceGetPersistenceMode / nvmlDeviceSetPersistenceMode: settings.c */

/* nvmlDeviceGetComputeMode / nvmlDeviceSetComputeMode: settings.c */

/* nvmlDeviceGetComputeRunningProcesses_v3: mig.c (processes make MIG instances "in use") */

/* ---------------------------------------------------------------------------------------------------------
 * Memory and attributes
 */
static unsigned long long mig_mem_bytes(const mock_gpu *g, const mock_gi *gi) {
    const mock_gi_profile *p = mock_gi_profile_by_id(g, gi->profileId);
    return p ? p->memorySizeMB * 1024ULL * 1024ULL : 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEV_ENTER(device, r, 1);
    if (!memory) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (r.mig) {
        memory->total = mig_mem_bytes(r.g, r.gi);
        memory->used = 0;
        memory->free = memory->total;
        RET(NVML_SUCCESS);
    }
    memory->total = (unsigned long long)r.g->v.memTotal;
    memory->used = (unsigned long long)(r.g->v.memReserved + r.g->v.memUsed);
    memory->free = memory->total - memory->used;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEV_ENTER(device, r, 1);
    if (!memory) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2) RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (r.mig) {
        memory->total = mig_mem_bytes(r.g, r.gi);
        memory->reserved = 0;
        memory->used = 0;
        memory->free = memory->total;
        RET(NVML_SUCCESS);
    }
    memory->total = (unsigned long long)r.g->v.memTotal;
    memory->reserved = (unsigned long long)r.g->v.memReserved;
    memory->used = (unsigned long long)r.g->v.memUsed;
    memory->free = memory->total - memory->reserved - memory->used;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory) {
    DEV_ENTER(device, r, 0);
    if (!bar1Memory) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.bar1Total);
    bar1Memory->bar1Total = (unsigned long long)r.g->v.bar1Total;
    bar1Memory->bar1Used = 2ULL * 1024 * 1024;
    bar1Memory->bar1Free = bar1Memory->bar1Total - bar1Memory->bar1Used;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    DEV_ENTER(device, r, 1);
    if (!attributes) RET(NVML_ERROR_INVALID_ARGUMENT);
    memset(attributes, 0, sizeof *attributes);
    if (r.mig) {
        const mock_gi_profile *gp = mock_gi_profile_by_id(r.g, r.gi->profileId);
        const mock_ci_profile *cp = gp ? mock_ci_profile_by_id(gp, r.ci->profileId) : NULL;
        if (!gp || !cp) RET(NVML_ERROR_UNKNOWN);
        attributes->multiprocessorCount = cp->multiprocessorCount;
        attributes->sharedCopyEngineCount = gp->copyEngineCount;
        attributes->sharedDecoderCount = gp->decoderCount;
        attributes->sharedEncoderCount = gp->encoderCount;
        attributes->sharedJpegCount = gp->jpegCount;
        attributes->sharedOfaCount = gp->ofaCount;
        attributes->gpuInstanceSliceCount = gp->sliceCount;
        attributes->computeInstanceSliceCount = cp->sliceCount;
        attributes->memorySizeMB = gp->memorySizeMB;
        RET(NVML_SUCCESS);
    }
    NEED(r.g->v.multiprocessorCount);
    attributes->multiprocessorCount = (unsigned)r.g->v.multiprocessorCount;
    attributes->memorySizeMB = (unsigned long long)r.g->v.memTotal / (1024ULL * 1024ULL);
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * MIG
 */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    DEV_ENTER(device, r, 0);
    if (!currentMode || !pendingMode) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.g->v.migCapable) RET(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = (unsigned)r.g->v.migCurrent;
    *pendingMode = (unsigned)r.g->v.migPending;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    DEV_ENTER(device, r, 0);
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    *count = (r.g->v.migCapable && r.g->v.migCurrent == 1) ? (unsigned)r.g->v.maxMigDeviceCount : 0;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice) {
    DEV_ENTER(device, r, 0);
    if (!migDevice) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.g->v.migCapable || r.g->v.migCurrent != 1) RET(NVML_ERROR_NOT_SUPPORTED);
    unsigned max = (unsigned)r.g->v.maxMigDeviceCount;
    if (max < r.g->nmig) max = r.g->nmig;
    if (index >= max) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (index >= r.g->nmig) RET(NVML_ERROR_NOT_FOUND);
    *migDevice = mig_handle(r.index, r.g->migGi[index], r.g->migCi[index]);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    DEV_ENTER(migDevice, r, 1);
    if (!device || !r.mig) RET(NVML_ERROR_INVALID_ARGUMENT);
    *device = mock_gpu_handle(r.index);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    DEV_ENTER(device, r, 1);
    if (!isMigDevice) RET(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = (unsigned)r.mig;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEV_ENTER(device, r, 1);
    if (!id) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.mig) RET(NVML_ERROR_NOT_SUPPORTED);
    *id = r.gi->id;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEV_ENTER(device, r, 1);
    if (!id) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.mig) RET(NVML_ERROR_NOT_SUPPORTED);
    *id = r.ci->id;
    RET(NVML_SUCCESS);
}

static void fill_gip(const mock_gi_profile *p, unsigned *id, unsigned *slice, unsigned *inst, unsigned *mp,
                     unsigned *ce, unsigned *dec, unsigned *enc, unsigned *jpeg, unsigned *ofa,
                     unsigned long long *mem) {
    *id = p->id; *slice = p->sliceCount; *inst = p->instanceCount; *mp = p->multiprocessorCount;
    *ce = p->copyEngineCount; *dec = p->decoderCount; *enc = p->encoderCount; *jpeg = p->jpegCount;
    *ofa = p->ofaCount; *mem = p->memorySizeMB;
}

static nvmlReturn_t gip_lookup(const dev_ref *r, unsigned profile, const mock_gi_profile **out) {
    if (!r->g->v.migCapable) return NVML_ERROR_NOT_SUPPORTED;
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (!r->g->gip[profile].valid) return NVML_ERROR_NOT_SUPPORTED;
    if (r->g->gip[profile].infoReturn) return (nvmlReturn_t)r->g->gip[profile].infoReturn;
    *out = &r->g->gip[profile];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile, nvmlGpuInstanceProfileInfo_t *info) {
    DEV_ENTER(device, r, 0);
    const mock_gi_profile *p;
    if (!info) RET(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t e = gip_lookup(&r, profile, &p);
    if (e) RET(e);
    memset(info, 0, sizeof *info);
    fill_gip(p, &info->id, &info->sliceCount, &info->instanceCount, &info->multiprocessorCount,
             &info->copyEngineCount, &info->decoderCount, &info->encoderCount, &info->jpegCount, &info->ofaCount,
             &info->memorySizeMB);
    info->isP2pSupported = p->isP2pSupported;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile, nvmlGpuInstanceProfileInfo_v2_t *info) {
    DEV_ENTER(device, r, 0);
    const mock_gi_profile *p;
    if (!info) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned version = info->version;
    if (version != nvmlGpuInstanceProfileInfo_v2 && version != nvmlGpuInstanceProfileInfo_v3)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    nvmlReturn_t e = gip_lookup(&r, profile, &p);
    if (e) RET(e);
    if (version == nvmlGpuInstanceProfileInfo_v2) {
        memset(info, 0, sizeof *info);
        info->version = version;
        fill_gip(p, &info->id, &info->sliceCount, &info->instanceCount, &info->multiprocessorCount,
                 &info->copyEngineCount, &info->decoderCount, &info->encoderCount, &info->jpegCount,
                 &info->ofaCount, &info->memorySizeMB);
        info->isP2pSupported = p->isP2pSupported;
        snprintf(info->name, sizeof info->name, "%s", p->name);
    } else {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)info;
        memset(v3, 0, sizeof *v3);
        v3->version = version;
        fill_gip(p, &v3->id, &v3->sliceCount, &v3->instanceCount, &v3->multiprocessorCount, &v3->copyEngineCount,
                 &v3->decoderCount, &v3->encoderCount, &v3->jpegCount, &v3->ofaCount, &v3->memorySizeMB);
        snprintf(v3->name, sizeof v3->name, "%s", p->name);
        v3->capabilities = 0;
    }
    RET(NVML_SUCCESS);
}

static const mock_gi_profile *gip_by_id_checked(const dev_ref *r, unsigned profileId, nvmlReturn_t *e) {
    if (!r->g->v.migCapable) { *e = NVML_ERROR_NOT_SUPPORTED; return NULL; }
    const mock_gi_profile *p = mock_gi_profile_by_id(r->g, profileId);
    if (!p) *e = NVML_ERROR_INVALID_ARGUMENT;
    return p;
}

nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                           nvmlGpuInstancePlacement_t *placements, unsigned int *count) {
    DEV_ENTER(device, r, 0);
    nvmlReturn_t e = NVML_SUCCESS;
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    const mock_gi_profile *p = gip_by_id_checked(&r, profileId, &e);
    if (!p) RET(e);
    if (p->placementsReturn) RET((nvmlReturn_t)p->placementsReturn);
    if (!placements) { *count = p->nstarts; RET(NVML_SUCCESS); }
    if (*count < p->nstarts) { *count = p->nstarts; RET(NVML_ERROR_INSUFFICIENT_SIZE); }
    for (unsigned k = 0; k < p->nstarts; k++) {
        placements[k].start = p->starts[k];
        placements[k].size = p->placementSize;
    }
    *count = p->nstarts;
    RET(NVML_SUCCESS);
}

static unsigned long long used_slices(const mock_gpu *g) {
    unsigned long long bits = 0;
    for (unsigned k = 0; k < MOCK_MAX_GI; k++)
        if (g->gi[k].exists) bits |= ((1ULL << g->gi[k].placement.size) - 1) << g->gi[k].placement.start;
    return bits;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId, unsigned int *count) {
    DEV_ENTER(device, r, 0);
    nvmlReturn_t e = NVML_SUCCESS;
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    const mock_gi_profile *p = gip_by_id_checked(&r, profileId, &e);
    if (!p) RET(e);
    if (r.g->v.migCurrent != 1) RET(NVML_ERROR_NOT_SUPPORTED);
    unsigned long long used = used_slices(r.g);
    unsigned existing = 0, free_places = 0;
    for (unsigned k = 0; k < MOCK_MAX_GI; k++) existing += r.g->gi[k].exists && r.g->gi[k].profileId == profileId;
    /* greedy: count non-overlapping free placements in start order */
    for (unsigned k = 0; k < p->nstarts; k++) {
        unsigned long long bits = ((1ULL << p->placementSize) - 1) << p->starts[k];
        if (!(used & bits)) { used |= bits; free_places++; }
    }
    unsigned left = p->instanceCount > existing ? p->instanceCount - existing : 0;
    *count = free_places < left ? free_places : left;
    RET(NVML_SUCCESS);
}

static nvmlGpuInstance_t gi_handle(unsigned gpu, unsigned gi) { return &h_gi[gpu][gi]; }
static nvmlComputeInstance_t ci_handle(unsigned gpu, unsigned gi, unsigned ci) { return &h_ci[gpu][gi][ci]; }
nvmlGpuInstance_t mock_gi_handle(unsigned gpu, unsigned gi) { return gi_handle(gpu, gi); }
nvmlComputeInstance_t mock_ci_handle(unsigned gpu, unsigned gi, unsigned ci) { return ci_handle(gpu, gi, ci); }

/* (gpu, gi id, ci id) of a compute-instance handle; 0 when it is not one (existence not checked). */
int mock_ci_handle_ref(nvmlComputeInstance_t h, unsigned *gpu, unsigned *gi, unsigned *ci) {
    if (!IN_TABLE(h, h_ci)) return 0;
    size_t off = (size_t)(h - &h_ci[0][0][0]);
    *gpu = (unsigned)(off / (MOCK_MAX_GI * MOCK_MAX_CI));
    *gi = (unsigned)(off / MOCK_MAX_CI % MOCK_MAX_GI);
    *ci = (unsigned)(off % MOCK_MAX_CI);
    return 1;
}

nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId, nvmlGpuInstance_t *gpuInstances,
                                       unsigned int *count) {
    DEV_ENTER(device, r, 0);
    nvmlReturn_t e = NVML_SUCCESS;
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    const mock_gi_profile *p = gip_by_id_checked(&r, profileId, &e);
    if (!p) RET(e);
    if (r.g->v.migCurrent != 1) RET(NVML_ERROR_NOT_SUPPORTED);
    unsigned n = 0;
    for (unsigned k = 0; k < MOCK_MAX_GI; k++) n += r.g->gi[k].exists && r.g->gi[k].profileId == profileId;
    if (!gpuInstances) { if (n) RET(NVML_ERROR_INVALID_ARGUMENT); *count = 0; RET(NVML_SUCCESS); }
    n = 0;
    for (unsigned k = 0; k < MOCK_MAX_GI; k++)
        if (r.g->gi[k].exists && r.g->gi[k].profileId == profileId) gpuInstances[n++] = gi_handle(r.index, k);
    *count = n;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance) {
    DEV_ENTER(device, r, 0);
    if (!gpuInstance) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.g->v.migCapable || r.g->v.migCurrent != 1) RET(NVML_ERROR_NOT_SUPPORTED);
    if (id >= MOCK_MAX_GI) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.g->gi[id].exists) RET(NVML_ERROR_NOT_FOUND);
    *gpuInstance = gi_handle(r.index, id);
    RET(NVML_SUCCESS);
}

static nvmlReturn_t enter_gi(const char *fn, nvmlGpuInstance_t h, gi_ref *r) {
    if (mock_unusable(&g_mock)) return (nvmlReturn_t)mock_unusable(&g_mock);
    if (!IN_TABLE(h, h_gi)) return NVML_ERROR_INVALID_ARGUMENT;
    size_t off = (size_t)(h - &h_gi[0][0]);
    r->gpu = (unsigned)(off / MOCK_MAX_GI);
    unsigned id = (unsigned)(off % MOCK_MAX_GI);
    if (r->gpu >= g_mock.ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    r->g = &g_mock.gpus[r->gpu];
    if (r->g->v.migCurrent != 1 || !r->g->gi[id].exists) return NVML_ERROR_INVALID_ARGUMENT;
    if (r->g->v.lost) return NVML_ERROR_GPU_IS_LOST;
    if (listed(g_mock.notSupported, g_mock.nNotSupported, fn) || listed(r->g->notSupported, r->g->nNotSupported, fn))
        return NVML_ERROR_NOT_SUPPORTED;
    r->gi = &r->g->gi[id];
    r->gp = mock_gi_profile_by_id(r->g, r->gi->profileId);
    if (!r->gp) return NVML_ERROR_UNKNOWN;
    return (nvmlReturn_t)mock_fault_locked(&g_mock, fn, (int)r->gpu);
}

nvmlReturn_t mock_enter_gi(const char *fn, nvmlGpuInstance_t h, gi_ref *r) { return enter_gi(fn, h, r); }

#define GI_ENTER(h, ref)                                                                                       \
    gi_ref ref;                                                                                                \
    LOCK();                                                                                                    \
    do { nvmlReturn_t e_ = enter_gi(__func__, (h), &ref); if (e_ != NVML_SUCCESS) RET(e_); } while (0)

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    GI_ENTER(gpuInstance, r);
    if (!info) RET(NVML_ERROR_INVALID_ARGUMENT);
    info->device = mock_gpu_handle(r.gpu);
    info->id = r.gi->id;
    info->profileId = r.gi->profileId;
    info->placement.start = r.gi->placement.start;
    info->placement.size = r.gi->placement.size;
    RET(NVML_SUCCESS);
}

static nvmlReturn_t cip_lookup(const gi_ref *r, unsigned profile, unsigned engProfile, const mock_ci_profile **out) {
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || engProfile >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!r->gp->ci[profile].valid) return NVML_ERROR_NOT_SUPPORTED;
    *out = &r->gp->ci[profile];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                          unsigned int engProfile, nvmlComputeInstanceProfileInfo_t *info) {
    GI_ENTER(gpuInstance, r);
    const mock_ci_profile *c;
    if (!info) RET(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t e = cip_lookup(&r, profile, engProfile, &c);
    if (e) RET(e);
    memset(info, 0, sizeof *info);
    info->id = c->id;
    info->sliceCount = c->sliceCount;
    info->instanceCount = c->instanceCount;
    info->multiprocessorCount = c->multiprocessorCount;
    info->sharedCopyEngineCount = r.gp->copyEngineCount;
    info->sharedDecoderCount = r.gp->decoderCount;
    info->sharedEncoderCount = r.gp->encoderCount;
    info->sharedJpegCount = r.gp->jpegCount;
    info->sharedOfaCount = r.gp->ofaCount;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                           unsigned int engProfile, nvmlComputeInstanceProfileInfo_v2_t *info) {
    GI_ENTER(gpuInstance, r);
    const mock_ci_profile *c;
    if (!info) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned version = info->version;
    if (version != nvmlComputeInstanceProfileInfo_v2 && version != nvmlComputeInstanceProfileInfo_v3)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    nvmlReturn_t e = cip_lookup(&r, profile, engProfile, &c);
    if (e) RET(e);
    /* v2 and v3 share the layout up to name; v3 adds capabilities at the end */
    if (version == nvmlComputeInstanceProfileInfo_v3) memset(info, 0, sizeof(nvmlComputeInstanceProfileInfo_v3_t));
    else memset(info, 0, sizeof *info);
    info->version = version;
    info->id = c->id;
    info->sliceCount = c->sliceCount;
    info->instanceCount = c->instanceCount;
    info->multiprocessorCount = c->multiprocessorCount;
    info->sharedCopyEngineCount = r.gp->copyEngineCount;
    info->sharedDecoderCount = r.gp->decoderCount;
    info->sharedEncoderCount = r.gp->encoderCount;
    info->sharedJpegCount = r.gp->jpegCount;
    info->sharedOfaCount = r.gp->ofaCount;
    snprintf(info->name, sizeof info->name, "%s", c->name);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                nvmlComputeInstance_t *computeInstances, unsigned int *count) {
    GI_ENTER(gpuInstance, r);
    if (!count) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!mock_ci_profile_by_id(r.gp, profileId)) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned n = 0;
    for (unsigned k = 0; k < MOCK_MAX_CI; k++) {
        if (!r.gi->ci[k].exists || r.gi->ci[k].profileId != profileId) continue;
        if (!computeInstances) RET(NVML_ERROR_INVALID_ARGUMENT);
        computeInstances[n++] = ci_handle(r.gpu, r.gi->id, k);
    }
    *count = n;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                   nvmlComputeInstance_t *computeInstance) {
    GI_ENTER(gpuInstance, r);
    if (!computeInstance || id >= MOCK_MAX_CI) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.gi->ci[id].exists) RET(NVML_ERROR_NOT_FOUND);
    *computeInstance = ci_handle(r.gpu, r.gi->id, id);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    LOCK();
    if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
    if (!IN_TABLE(computeInstance, h_ci) || !info) RET(NVML_ERROR_INVALID_ARGUMENT);
    size_t off = (size_t)(computeInstance - &h_ci[0][0][0]);
    unsigned gpu = (unsigned)(off / (MOCK_MAX_GI * MOCK_MAX_CI));
    unsigned gi = (unsigned)(off / MOCK_MAX_CI % MOCK_MAX_GI), ci = (unsigned)(off % MOCK_MAX_CI);
    if (gpu >= g_mock.ngpus) RET(NVML_ERROR_INVALID_ARGUMENT);
    mock_gpu *g = &g_mock.gpus[gpu];
    if (g->v.migCurrent != 1 || !g->gi[gi].exists || !g->gi[gi].ci[ci].exists) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (g->v.lost) RET(NVML_ERROR_GPU_IS_LOST);
    if (listed(g_mock.notSupported, g_mock.nNotSupported, __func__) || listed(g->notSupported, g->nNotSupported, __func__))
        RET(NVML_ERROR_NOT_SUPPORTED);
    nvmlReturn_t fe = (nvmlReturn_t)mock_fault_locked(&g_mock, __func__, (int)gpu);
    if (fe != NVML_SUCCESS) RET(fe);
    const mock_ci *c = &g->gi[gi].ci[ci];
    info->device = mock_gpu_handle(gpu);
    info->gpuInstance = gi_handle(gpu, gi);
    info->id = c->id;
    info->profileId = c->profileId;
    info->placement.start = c->placement.start;
    info->placement.size = c->placement.size;
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * Fabric
 */
/* What the fabric manager assigns at registration: until the state is COMPLETED the GPU has no cluster UUID and no
 * clique ID yet (all zeros; nvidia-smi prints N/A), so a GPU that finishes registering at run time reports the
 * profile's values from then on. */
static void fabric_identity(const mock_gpu *g, unsigned char *uuid, unsigned *cliqueId) {
    int registered = g->v.fabricState == NVML_GPU_FABRIC_STATE_COMPLETED;
    if (registered) memcpy(uuid, g->clusterUuid, NVML_GPU_FABRIC_UUID_LEN);
    else memset(uuid, 0, NVML_GPU_FABRIC_UUID_LEN);
    *cliqueId = registered ? (unsigned)g->v.fabricCliqueId : 0;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *gpuFabricInfo) {
    DEV_ENTER(device, r, 0);
    if (!gpuFabricInfo) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.g->hasFabric) RET(NVML_ERROR_NOT_SUPPORTED);
    fabric_identity(r.g, gpuFabricInfo->clusterUuid, &gpuFabricInfo->cliqueId);
    gpuFabricInfo->status = (nvmlReturn_t)r.g->v.fabricStatus;
    gpuFabricInfo->state = (nvmlGpuFabricState_t)r.g->v.fabricState;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *gpuFabricInfo) {
    DEV_ENTER(device, r, 0);
    if (!gpuFabricInfo) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned version = gpuFabricInfo->version;
    if (version != nvmlGpuFabricInfo_v2 && version != nvmlGpuFabricInfo_v3) RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (!r.g->hasFabric) RET(NVML_ERROR_NOT_SUPPORTED);
    if (version == nvmlGpuFabricInfo_v2) {
        nvmlGpuFabricInfo_v2_t *v2 = (nvmlGpuFabricInfo_v2_t *)gpuFabricInfo;
        fabric_identity(r.g, v2->clusterUuid, &v2->cliqueId);
        v2->status = (nvmlReturn_t)r.g->v.fabricStatus;
        v2->state = (nvmlGpuFabricState_t)r.g->v.fabricState;
        v2->healthMask = (unsigned)r.g->v.fabricHealthMask;
    } else {
        fabric_identity(r.g, gpuFabricInfo->clusterUuid, &gpuFabricInfo->cliqueId);
        gpuFabricInfo->status = (nvmlReturn_t)r.g->v.fabricStatus;
        gpuFabricInfo->state = (nvmlGpuFabricState_t)r.g->v.fabricState;
        gpuFabricInfo->healthMask = (unsigned)r.g->v.fabricHealthMask;
        gpuFabricInfo->healthSummary = (unsigned char)r.g->v.fabricHealthSummary;
    }
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * Telemetry (static per profile unless changed through the runtime control)
 */
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEV_ENTER(device, r, 0);
    if (!utilization) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.utilGpu);
    utilization->gpu = (unsigned)r.g->v.utilGpu;
    utilization->memory = r.g->v.utilMemory == MOCK_ABSENT ? 0 : (unsigned)r.g->v.utilMemory;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp) {
    DEV_ENTER(device, r, 0);
    if (!temp || sensorType != NVML_TEMPERATURE_GPU) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.temperature);
    *temp = (unsigned)r.g->v.temperature;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature) {
    DEV_ENTER(device, r, 0);
    if (!temperature || temperature->sensorType != NVML_TEMPERATURE_GPU) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->version != nvmlTemperature_v1) RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    NEED(r.g->v.temperature);
    temperature->temperature = (int)r.g->v.temperature;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEV_ENTER(device, r, 0);
    if (!power) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.powerUsage);
    *power = (unsigned)r.g->v.powerUsage;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    DEV_ENTER(device, r, 0);
    if (!limit) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.powerLimit);
    *limit = (unsigned)r.g->v.powerLimit;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    DEV_ENTER(device, r, 0);
    if (!limit) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.powerLimit);
    *limit = (unsigned)r.g->v.powerLimit;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *minLimit, unsigned int *maxLimit) {
    DEV_ENTER(device, r, 0);
    if (!minLimit || !maxLimit) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.powerMinLimit);
    NEED(r.g->v.powerMaxLimit);
    *minLimit = (unsigned)r.g->v.powerMinLimit;
    *maxLimit = (unsigned)r.g->v.powerMaxLimit;
    RET(NVML_SUCCESS);
}

static unsigned long long energy_mj(const mock_gpu *g) {
    if (g->v.energy != MOCK_ABSENT) return (unsigned long long)g->v.energy;
    /* power (mW) integrated since init: mW * us / 1e6 = mJ */
    long long us = 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    us = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000 - g_mock.initMonotonicUs;
    return (unsigned long long)(g->v.powerUsage * (us / 1000)) / 1000ULL;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy) {
    DEV_ENTER(device, r, 0);
    if (!energy) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.powerUsage);
    *energy = energy_mj(r.g);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock) {
    DEV_ENTER(device, r, 0);
    if (!clock || (unsigned)type >= NVML_CLOCK_COUNT) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.clocks[type]);
    *clock = (unsigned)r.g->v.clocks[type];
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock) {
    DEV_ENTER(device, r, 0);
    if (!clock || (unsigned)type >= NVML_CLOCK_COUNT) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED(r.g->v.maxClocks[type]);
    *clock = (unsigned)r.g->v.maxClocks[type];
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, nvmlPcieUtilCounter_t counter, unsigned int *value) {
    DEV_ENTER(device, r, 0);
    if (!value || (unsigned)counter >= NVML_PCIE_UTIL_COUNT) RET(NVML_ERROR_INVALID_ARGUMENT);
    long long v = counter == NVML_PCIE_UTIL_TX_BYTES ? r.g->v.pcieTx : r.g->v.pcieRx;
    NEED(v);
    *value = (unsigned)v;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current, nvmlEnableState_t *pending) {
    DEV_ENTER(device, r, 0);
    if (!current || !pending) RET(NVML_ERROR_INVALID_ARGUMENT);
    *current = *pending = r.g->v.eccMode ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    RET(NVML_SUCCESS);
}

static long long ecc_value(const mock_gpu *g, nvmlMemoryErrorType_t errorType, nvmlEccCounterType_t counterType) {
    int unc = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED, agg = counterType == NVML_AGGREGATE_ECC;
    return unc ? (agg ? g->v.eccAggUnc : g->v.eccVolUnc) : (agg ? g->v.eccAggCorr : g->v.eccVolCorr);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType, unsigned long long *eccCounts) {
    DEV_ENTER(device, r, 0);
    if (!eccCounts || (unsigned)errorType >= NVML_MEMORY_ERROR_TYPE_COUNT || (unsigned)counterType >= NVML_ECC_COUNTER_TYPE_COUNT)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.g->v.eccMode) RET(NVML_ERROR_NOT_SUPPORTED);
    *eccCounts = (unsigned long long)ecc_value(r.g, errorType, counterType);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                             nvmlEccCounterType_t counterType, nvmlMemoryLocation_t locationType,
                                             unsigned long long *count) {
    DEV_ENTER(device, r, 0);
    if (!count || (unsigned)errorType >= NVML_MEMORY_ERROR_TYPE_COUNT || (unsigned)counterType >= NVML_ECC_COUNTER_TYPE_COUNT ||
        (unsigned)locationType >= NVML_MEMORY_LOCATION_COUNT)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!r.g->v.eccMode) RET(NVML_ERROR_NOT_SUPPORTED);
    *count = locationType == NVML_MEMORY_LOCATION_DEVICE_MEMORY ? (unsigned long long)ecc_value(r.g, errorType, counterType) : 0;
    RET(NVML_SUCCESS);
}

static nvmlReturn_t pages(const mock_gpu *g, nvmlPageRetirementCause_t cause, unsigned int *pageCount,
                          unsigned long long *addresses, unsigned long long *timestamps) {
    if (!pageCount || (unsigned)cause >= NVML_PAGE_RETIREMENT_CAUSE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS ? g->nSbePages : g->nDbePages;
    const unsigned long long *src = cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS ? g->sbePages : g->dbePages;
    if (*pageCount < n || (n && !addresses)) { *pageCount = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    for (unsigned k = 0; k < n; k++) {
        addresses[k] = src[k];
        if (timestamps) timestamps[k] = 1700000000ULL * 1000000ULL; /* microseconds since the epoch */
    }
    *pageCount = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause, unsigned int *pageCount,
                                       unsigned long long *addresses) {
    DEV_ENTER(device, r, 0);
    RET(pages(r.g, cause, pageCount, addresses, NULL));
}

nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, nvmlPageRetirementCause_t cause, unsigned int *pageCount,
                                          unsigned long long *addresses, unsigned long long *timestamps) {
    DEV_ENTER(device, r, 0);
    RET(pages(r.g, cause, pageCount, addresses, timestamps));
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending) {
    DEV_ENTER(device, r, 0);
    if (!isPending) RET(NVML_ERROR_INVALID_ARGUMENT);
    *isPending = r.g->v.retiredPending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred) {
    DEV_ENTER(device, r, 0);
    if (!corrRows || !uncRows || !isPending || !failureOccurred) RET(NVML_ERROR_INVALID_ARGUMENT);
    *corrRows = (unsigned)r.g->v.remapCorr;
    *uncRows = (unsigned)r.g->v.remapUnc;
    *isPending = (unsigned)(r.g->v.remapPending != 0);
    *failureOccurred = (unsigned)(r.g->v.remapFailure != 0);
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * Field values
 */
static nvmlReturn_t field_value(const mock_gpu *g, unsigned fieldId, nvmlValueType_t *type, nvmlValue_t *val) {
    const mock_scalars *s = &g->v;
    long long v;
    *type = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
    switch (fieldId) {
    case NVML_FI_DEV_ECC_CURRENT: case NVML_FI_DEV_ECC_PENDING:
        *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = (unsigned)(s->eccMode != 0); return NVML_SUCCESS;
    case NVML_FI_DEV_ECC_SBE_VOL_TOTAL: case NVML_FI_DEV_ECC_SBE_VOL_DEV: v = s->eccVolCorr; goto ecc;
    case NVML_FI_DEV_ECC_DBE_VOL_TOTAL: case NVML_FI_DEV_ECC_DBE_VOL_DEV: v = s->eccVolUnc; goto ecc;
    case NVML_FI_DEV_ECC_SBE_AGG_TOTAL: case NVML_FI_DEV_ECC_SBE_AGG_DEV: v = s->eccAggCorr; goto ecc;
    case NVML_FI_DEV_ECC_DBE_AGG_TOTAL: case NVML_FI_DEV_ECC_DBE_AGG_DEV: v = s->eccAggUnc; goto ecc;
    ecc:
        if (!s->eccMode) return NVML_ERROR_NOT_SUPPORTED;
        val->ullVal = (unsigned long long)v;
        return NVML_SUCCESS;
    case NVML_FI_DEV_RETIRED_SBE: *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = g->nSbePages; return NVML_SUCCESS;
    case NVML_FI_DEV_RETIRED_DBE: *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = g->nDbePages; return NVML_SUCCESS;
    case NVML_FI_DEV_RETIRED_PENDING: case NVML_FI_DEV_RETIRED_PENDING_SBE: case NVML_FI_DEV_RETIRED_PENDING_DBE:
        *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = (unsigned)(s->retiredPending != 0); return NVML_SUCCESS;
    case NVML_FI_DEV_MEMORY_TEMP: case NVML_FI_DEV_GPU_TEMP:
        if (s->temperature == MOCK_ABSENT) return NVML_ERROR_NOT_SUPPORTED;
        *type = NVML_VALUE_TYPE_UNSIGNED_INT;
        val->uiVal = (unsigned)(s->temperature + (fieldId == NVML_FI_DEV_MEMORY_TEMP ? 4 : 0));
        return NVML_SUCCESS;
    case NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
        if (s->powerUsage == MOCK_ABSENT) return NVML_ERROR_NOT_SUPPORTED;
        val->ullVal = energy_mj(g);
        return NVML_SUCCESS;
    case NVML_FI_DEV_REMAPPED_COR: *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = (unsigned)s->remapCorr; return NVML_SUCCESS;
    case NVML_FI_DEV_REMAPPED_UNC: *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = (unsigned)s->remapUnc; return NVML_SUCCESS;
    case NVML_FI_DEV_REMAPPED_PENDING: *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = (unsigned)(s->remapPending != 0); return NVML_SUCCESS;
    case NVML_FI_DEV_REMAPPED_FAILURE: *type = NVML_VALUE_TYPE_UNSIGNED_INT; val->uiVal = (unsigned)(s->remapFailure != 0); return NVML_SUCCESS;
    case NVML_FI_DEV_POWER_AVERAGE: case NVML_FI_DEV_POWER_INSTANT: v = s->powerUsage; goto mw;
    case NVML_FI_DEV_POWER_MIN_LIMIT: v = s->powerMinLimit; goto mw;
    case NVML_FI_DEV_POWER_MAX_LIMIT: case NVML_FI_DEV_POWER_DEFAULT_LIMIT: v = s->powerMaxLimit; goto mw;
    case NVML_FI_DEV_POWER_CURRENT_LIMIT: case NVML_FI_DEV_POWER_REQUESTED_LIMIT: v = s->powerLimit; goto mw;
    mw:
        if (v == MOCK_ABSENT) return NVML_ERROR_NOT_SUPPORTED;
        *type = NVML_VALUE_TYPE_UNSIGNED_INT;
        val->uiVal = (unsigned)v;
        return NVML_SUCCESS;
    case NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: v = s->recoveryAction; goto mw;  /* nvmlGpuRecoveryAction_t */
    case NVML_FI_DEV_PCIE_COUNT_TX_BYTES: case NVML_FI_DEV_PCIE_COUNT_RX_BYTES: {
        v = fieldId == NVML_FI_DEV_PCIE_COUNT_TX_BYTES ? s->pcieTx : s->pcieRx;
        if (v == MOCK_ABSENT) return NVML_ERROR_NOT_SUPPORTED;
        /* KB/s since init, as a byte counter */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        long long us = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000 - g_mock.initMonotonicUs;
        val->ullVal = (unsigned long long)(v * 1024LL) * (unsigned long long)(us / 1000) / 1000ULL;
        return NVML_SUCCESS;
    }
    default:
        return NVML_ERROR_NOT_SUPPORTED;
    }
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values) {
    DEV_ENTER(device, r, 1);
    if (!values || valuesCount < 0) RET(NVML_ERROR_INVALID_ARGUMENT);
    struct timeval tv;
    gettimeofday(&tv, NULL);
    long long ts = (long long)tv.tv_sec * 1000000LL + tv.tv_usec;
    for (int k = 0; k < valuesCount; k++) {
        nvmlFieldValue_t *f = &values[k];
        f->timestamp = ts;
        f->latencyUsec = 0;
        memset(&f->value, 0, sizeof f->value);
        f->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        if (r.mig) { f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED; continue; }
        f->nvmlReturn = field_value(r.g, f->fieldId, &f->valueType, &f->value);
    }
    RET(NVML_SUCCESS);
}
