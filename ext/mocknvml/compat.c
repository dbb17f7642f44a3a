/* Unversioned and older-versioned NVML entry points that nvml.h maps to newer names by macro. Older callers
 * (and dlsym users that look up the plain names) find them here; each forwards to the current version. */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <stddef.h>
#include <string.h>

#include "mocknvml.h"

nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}
/* v1/v2 filled the struct only up to pciSubSystemId (the old layout had reserved fields after it) */
static nvmlReturn_t pci_prefix(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    nvmlPciInfo_t full;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = nvmlDeviceGetPciInfo_v3(device, &full);
    if (r == NVML_SUCCESS) memcpy(pci, &full, offsetof(nvmlPciInfo_t, busId));
    return r;
}
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { return pci_prefix(device, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return pci_prefix(device, pci); }
nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    return nvmlDeviceGetAttributes_v2(device, attributes);
}
nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    return nvmlComputeInstanceGetInfo_v2(computeInstance, info);
}
nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(nvmlDevice_t device, unsigned int profileId,
                                                        nvmlGpuInstancePlacement_t *placements, unsigned int *count) {
    return nvmlDeviceGetGpuInstancePossiblePlacements_v2(device, profileId, placements, count);
}
