/* Internal state of the mock NVML library (not installed, not part of any ABI). */
#ifndef MOCKNVML_INTERNAL_H
#define MOCKNVML_INTERNAL_H

#include <pthread.h>
#include <stddef.h>

/* NVML entry points keep default visibility; everything else in the library is hidden. */
#pragma GCC visibility push(default)
#include "nvml.h"
#pragma GCC visibility pop

#define MOCK_EXPORT __attribute__((visibility("default")))

#define MOCK_MAX_GPUS 128
#define MOCK_MAX_GI 15        /* GPU instance ids 0..14 */
#define MOCK_MAX_CI 8         /* compute instance ids 0..7 */
#define MOCK_MAX_MIG (MOCK_MAX_GI * MOCK_MAX_CI)
#define MOCK_MAX_STARTS 8
#define MOCK_MAX_NAMES 64
#define MOCK_MAX_PAGES 64
#define MOCK_MAX_EVENTS 256
#define MOCK_MAX_SETS 64
#define MOCK_STR 96
#define MOCK_ABSENT (-1LL)

typedef struct {
    unsigned start, size;
} mock_place;

typedef struct {
    int valid;
    unsigned index, id, sliceCount, instanceCount, multiprocessorCount;
    char name[MOCK_STR];
} mock_ci_profile;

typedef struct {
    int valid;
    unsigned index, id, sliceCount, instanceCount, multiprocessorCount;
    unsigned copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount, isP2pSupported;
    unsigned long long memorySizeMB;
    int infoReturn, placementsReturn; /* non-zero: the nvmlReturn_t NVML answers for this profile */
    char name[MOCK_STR];
    unsigned nstarts, starts[MOCK_MAX_STARTS], placementSize;
    mock_ci_profile ci[NVML_COMPUTE_INSTANCE_PROFILE_COUNT];
} mock_gi_profile;

typedef struct {
    int exists;
    unsigned id, profileId;
    mock_place placement;
    char uuid[MOCK_STR];
    char name[MOCK_STR];
    long long computeMode; /* nvmlComputeMode_t of this MIG device (settings.c); 0 DEFAULT */
    unsigned procs; /* processes running on this compute instance ("in use"; mig.c) */
} mock_ci;

typedef struct {
    int exists;
    unsigned id, profileId;
    mock_place placement;
    mock_ci ci[MOCK_MAX_CI];
} mock_gi;

typedef struct {
    unsigned long long type, data;
    unsigned gi, ci;
} mock_event;

/* Scalar values, every one a long long so one table (mock_scalar_keys) drives both profile parsing and the
 * runtime "set" command. MOCK_ABSENT means the profile did not give it: the call returns NOT_SUPPORTED. */
typedef struct {
    long long brand, architecture, ccMajor, ccMinor, pciDeviceId, pciSubSystemId, minorNumber, numaNode, boardId;
    long long multiprocessorCount, memTotal, memReserved, memUsed, bar1Total;
    long long migCapable, migCurrent, migPending, maxMigDeviceCount;
    long long powerUsage, powerLimit, powerMinLimit, powerMaxLimit, temperature, utilGpu, utilMemory;
    long long clocks[NVML_CLOCK_COUNT], maxClocks[NVML_CLOCK_COUNT];
    long long pcieTx, pcieRx, pcieMaxGen, eccMode;
    long long eccVolCorr, eccVolUnc, eccAggCorr, eccAggUnc;
    long long retiredPending, remapCorr, remapUnc, remapPending, remapFailure;
    long long supportedEvents, lost, energy, addressingMode, recoveryAction, virtualizationMode;
    long long computeMode, computeTimeslice, noPermission, persistenceMode; /* settings.c */
    long long moduleId; /* nvmlDeviceGetModuleId; Fabric Manager's GPU physical ID */
    long long fabricCliqueId, fabricState, fabricStatus, fabricHealthMask, fabricHealthSummary;
} mock_scalars;

typedef struct {
    char name[MOCK_STR], uuid[MOCK_STR], serial[MOCK_STR], busId[32], busIdLegacy[16];
    unsigned domain, bus, device;
    mock_scalars v;
    int hasFabric;
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    unsigned nSbePages, nDbePages;
    unsigned long long sbePages[MOCK_MAX_PAGES], dbePages[MOCK_MAX_PAGES];
    mock_gi_profile gip[NVML_GPU_INSTANCE_PROFILE_COUNT];
    mock_gi gi[MOCK_MAX_GI];
    unsigned nmig;
    unsigned char migGi[MOCK_MAX_MIG], migCi[MOCK_MAX_MIG]; /* MIG device index -> (gi id, ci id) */
    unsigned nNotSupported;
    char notSupported[MOCK_MAX_NAMES][64];
    unsigned nPending;
    mock_event pending[MOCK_MAX_EVENTS]; /* queued for the first event set that registers this GPU */
    unsigned procs;                      /* processes on the full GPU, outside any MIG device (mig.c) */
} mock_gpu;

typedef struct {
    const char *key;
    size_t offset;
} mock_scalar_key;

extern const mock_scalar_key mock_scalar_keys[];
long long *mock_scalar(mock_gpu *g, const char *key);

#endif
