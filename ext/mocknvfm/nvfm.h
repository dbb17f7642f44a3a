/* The Fabric Manager SDK C ABI the mock implements: types, sizes, version macros and return codes as NVIDIA's
 * nv_fm_types.h and nv_fm_agent.h define them (libnvfm1 / libnvfm-dev packages of nvidia-fabricmanager, e.g. the
 * Debian packaging at github.com/pexip/os-nvidia-fabricmanager include/; NVIDIA Fabric Manager User Guide, "Fabric
 * Manager SDK"). Written from those definitions; only what the mock needs. */
#ifndef MOCKNVFM_NVFM_H
#define MOCKNVFM_NVFM_H

typedef enum {
    FM_ST_SUCCESS = 0,
    FM_ST_BADPARAM = -1,
    FM_ST_GENERIC_ERROR = -2,
    FM_ST_NOT_SUPPORTED = -3,
    FM_ST_UNINITIALIZED = -4,
    FM_ST_TIMEOUT = -5,
    FM_ST_VERSION_MISMATCH = -6,
    FM_ST_IN_USE = -7,
    FM_ST_NOT_CONFIGURED = -8,
    FM_ST_CONNECTION_NOT_VALID = -9,
    FM_ST_NVLINK_ERROR = -10,
} fmReturn_t;

typedef void *fmHandle_t;
typedef unsigned int fmFabricPartitionId_t;

#define FM_MAX_STR_LENGTH 256
#define FM_UUID_BUFFER_SIZE 80
#define FM_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define FM_MAX_NUM_GPUS 16
#define FM_MAX_FABRIC_PARTITIONS 64
#define MAKE_FM_PARAM_VERSION(typeName, ver) (unsigned int)(sizeof(typeName) | ((ver) << 24))

typedef struct {
    unsigned int version;
    char addressInfo[FM_MAX_STR_LENGTH];
    unsigned int timeoutMs;
    unsigned int addressIsUnixSocket;
} fmConnectParams_v1;
typedef fmConnectParams_v1 fmConnectParams_t;
#define fmConnectParams_version MAKE_FM_PARAM_VERSION(fmConnectParams_v1, 1)

typedef struct {
    unsigned int physicalId; /* the GPU's module ID */
    char uuid[FM_UUID_BUFFER_SIZE];
    char pciBusId[FM_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int numNvLinksAvailable;
    unsigned int maxNumNvLinks;
    unsigned int nvlinkLineRateMBps;
} fmFabricPartitionGpuInfo_t;

typedef struct {
    fmFabricPartitionId_t partitionId;
    unsigned int isActive;
    unsigned int numGpus;
    fmFabricPartitionGpuInfo_t gpuInfo[FM_MAX_NUM_GPUS];
} fmFabricPartitionInfo_t;

typedef struct {
    unsigned int version;
    unsigned int numPartitions;
    unsigned int maxNumPartitions;
    fmFabricPartitionInfo_t partitionInfo[FM_MAX_FABRIC_PARTITIONS];
} fmFabricPartitionList_v2;
typedef fmFabricPartitionList_v2 fmFabricPartitionList_t;
#define fmFabricPartitionList_version MAKE_FM_PARAM_VERSION(fmFabricPartitionList_v2, 1)

typedef struct {
    unsigned int version;
    unsigned int numPartitions;
    fmFabricPartitionId_t partitionIds[FM_MAX_FABRIC_PARTITIONS];
} fmActivatedFabricPartitionList_v1;
typedef fmActivatedFabricPartitionList_v1 fmActivatedFabricPartitionList_t;
#define fmActivatedFabricPartitionList_version MAKE_FM_PARAM_VERSION(fmActivatedFabricPartitionList_v1, 1)

#define FM_API __attribute__((visibility("default")))

FM_API fmReturn_t fmLibInit(void);
FM_API fmReturn_t fmLibShutdown(void);
FM_API fmReturn_t fmConnect(fmConnectParams_t *connectParams, fmHandle_t *pFmHandle);
FM_API fmReturn_t fmDisconnect(fmHandle_t pFmHandle);
FM_API fmReturn_t fmGetSupportedFabricPartitions(fmHandle_t pFmHandle, fmFabricPartitionList_t *pFmFabricPartition);
FM_API fmReturn_t fmActivateFabricPartition(fmHandle_t pFmHandle, fmFabricPartitionId_t partitionId);
FM_API fmReturn_t fmDeactivateFabricPartition(fmHandle_t pFmHandle, fmFabricPartitionId_t partitionId);
FM_API fmReturn_t fmSetActivatedFabricPartitions(fmHandle_t pFmHandle,
                                                 fmActivatedFabricPartitionList_t *pFmActivatedPartitionList);

#endif
