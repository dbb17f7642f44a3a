/* Device settings the driver keeps for the life of the node (until reboot): compute mode, the compute
 * time-slice and the legacy persistence mode.
 *
 * Compute mode: nvmlDeviceGetComputeMode / nvmlDeviceSetComputeMode, with the return codes nvml.h documents
 * (INVALID_ARGUMENT for a bad handle or mode, NO_PERMISSION for a caller that is not root, GPU_IS_LOST, and
 * NOT_SUPPORTED; nvml.h: "If MIG is enabled on a GPU, device must be MIG device handle", so a full-GPU handle
 * of a MIG-enabled GPU gets NOT_SUPPORTED from the setter here; real NVML's exact code for that case is
 * unconfirmed; the getter answers on it).
 * NVML_COMPUTEMODE_EXCLUSIVE_THREAD is "Support Removed" in nvml.h: setting it gives NOT_SUPPORTED.
 *
 * Compute time-slice (nvidia-smi compute-policy --set-timeslice 0..3 = DEFAULT, SHORT, MEDIUM, LONG): NVML has
 * no public call for it (nvml.h only has the vGPU scheduler calls), so the mock exports its own pair,
 * mocknvml_device_set_timeslice / mocknvml_device_get_timeslice, which the sandbox's nvidia-smi stand-in and
 * tests call through the same handles as NVML. Full GPUs only (MIG handles: NOT_SUPPORTED).
 *
 * Persistence mode: nvmlDeviceGetPersistenceMode / nvmlDeviceSetPersistenceMode (nvml.h: Linux only, "This API
 * is deprecated. Use nvidia-persistenced instead"; the setter needs root; INVALID_ARGUMENT for a bad handle or a
 * mode other than NVML_FEATURE_DISABLED/ENABLED, NO_PERMISSION, GPU_IS_LOST, NOT_SUPPORTED). Full GPUs only (a MIG
 * handle: NOT_SUPPORTED, as for every full-GPU call of the mock). Default ENABLED, as a node whose driver container runs
 * nvidia-persistenced shows it; a profile may give `persistenceMode` 0.
 *
 * The mock is "root": setters succeed unless `set <gpu> noPermission 1` emulates an unprivileged caller.
 *
 * Settings are state of the (emulated) kernel driver, shared by every process on the node: with a control file
 * (DRADRIVER_MOCK_NVML_CONTROL), every successful set is also appended to that file as a control command
 * (`set <gpu> computeMode <m>`, `set <gpu> computeTimeslice <n>`, `set <gpu> persistenceMode <m>`,
 * `computemode <gpu> <gi> <ci> <m>`), so every
 * other process using the mock with the same control file sees it at its next NVML call, and a later nvmlInit
 * replays it. Without a control file a setting is local to the process. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "mocknvml.h"
#include "state.h"

#define LOCK() do { pthread_mutex_lock(&g_mock_lock); mock_poll_control_locked(&g_mock); } while (0)
#define RET(x) do { nvmlReturn_t r_ = (x); pthread_mutex_unlock(&g_mock_lock); return r_; } while (0)
#define DEV_ENTER(h, ref, allow_mig)                                                                          \
    mock_dev_ref ref;                                                                                         \
    LOCK();                                                                                                   \
    do { nvmlReturn_t e_ = mock_enter_dev(__func__, (h), &ref, (allow_mig)); if (e_ != NVML_SUCCESS) RET(e_); } while (0)

#define NEED_SETTING(v) do { if ((long long)(v) < 0) RET(NVML_ERROR_NOT_SUPPORTED); } while (0) /* -1: not supported */
#define MOCK_TIMESLICE_MAX 3 /* nvidia-smi compute-policy: 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG */

/* Append one control command to the shared control file (if any). Lock held. The read offset stays where it
 * is: lines other processes appended since this process's last poll must still be applied, in file order. */
static void write_through_locked(const char *line) {
    if (!g_mock.controlPath[0]) return;
    int fd = open(g_mock.controlPath, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "mocknvml: cannot append to control file %s\n", g_mock.controlPath);
        return;
    }
    size_t n = strlen(line);
    ssize_t w = write(fd, line, n); /* one write(2) of a short line with O_APPEND: not interleaved */
    close(fd);
    if (w != (ssize_t)n) fprintf(stderr, "mocknvml: short write to control file %s\n", g_mock.controlPath);
    /* Lines other processes appended before ours are applied at the next poll; ours is applied again there,
     * which is harmless because every command here sets an absolute value. */
}

static int valid_mode(nvmlComputeMode_t mode) { return (unsigned)mode < NVML_COMPUTEMODE_COUNT; }

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    DEV_ENTER(device, r, 1);
    if (!mode) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (r.mig) {
        *mode = (nvmlComputeMode_t)r.ci->computeMode;
        RET(NVML_SUCCESS);
    }
    *mode = (nvmlComputeMode_t)r.g->v.computeMode; /* readable whatever the MIG mode, as nvidia-smi -q shows it */
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    DEV_ENTER(device, r, 1);
    if (!valid_mode(mode)) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (mode == NVML_COMPUTEMODE_EXCLUSIVE_THREAD) RET(NVML_ERROR_NOT_SUPPORTED);
    if (!r.mig && r.g->v.migCurrent == 1) RET(NVML_ERROR_NOT_SUPPORTED);
    if (r.g->v.noPermission) RET(NVML_ERROR_NO_PERMISSION);
    char line[128];
    if (r.mig) {
        r.ci->computeMode = mode;
        snprintf(line, sizeof line, "computemode %u %u %u %d\n", r.index, r.gi->id, r.ci->id, (int)mode);
    } else {
        r.g->v.computeMode = mode;
        snprintf(line, sizeof line, "set %u computeMode %d\n", r.index, (int)mode);
    }
    write_through_locked(line);
    RET(NVML_SUCCESS);
}

int mock_set_mig_compute_mode_locked(mock_state *st, unsigned gpu, unsigned gi, unsigned ci, long long mode) {
    if (gpu >= st->ngpus || gi >= MOCK_MAX_GI || ci >= MOCK_MAX_CI) return NVML_ERROR_INVALID_ARGUMENT;
    mock_ci *c = &st->gpus[gpu].gi[gi].ci[ci];
    if (!st->gpus[gpu].gi[gi].exists || !c->exists) return NVML_ERROR_NOT_FOUND;
    if (mode < 0 || mode >= NVML_COMPUTEMODE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    c->computeMode = mode;
    return NVML_SUCCESS;
}

/* The mock's stand-in for the driver's private compute time-slice control (see the file comment). */
MOCK_EXPORT nvmlReturn_t mocknvml_device_set_timeslice(nvmlDevice_t device, unsigned int timeslice) {
    DEV_ENTER(device, r, 0);
    if (timeslice > MOCK_TIMESLICE_MAX) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (r.g->v.noPermission) RET(NVML_ERROR_NO_PERMISSION);
    r.g->v.computeTimeslice = timeslice;
    char line[96];
    snprintf(line, sizeof line, "set %u computeTimeslice %u\n", r.index, timeslice);
    write_through_locked(line);
    RET(NVML_SUCCESS);
}

MOCK_EXPORT nvmlReturn_t mocknvml_device_get_timeslice(nvmlDevice_t device, unsigned int *timeslice) {
    DEV_ENTER(device, r, 0);
    if (!timeslice) RET(NVML_ERROR_INVALID_ARGUMENT);
    *timeslice = (unsigned)r.g->v.computeTimeslice;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode) {
    DEV_ENTER(device, r, 0);
    if (!mode) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED_SETTING(r.g->v.persistenceMode);
    *mode = r.g->v.persistenceMode ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceSetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t mode) {
    DEV_ENTER(device, r, 0);
    if (mode != NVML_FEATURE_DISABLED && mode != NVML_FEATURE_ENABLED) RET(NVML_ERROR_INVALID_ARGUMENT);
    NEED_SETTING(r.g->v.persistenceMode);
    if (r.g->v.noPermission) RET(NVML_ERROR_NO_PERMISSION);
    r.g->v.persistenceMode = mode;
    char line[96];
    snprintf(line, sizeof line, "set %u persistenceMode %d\n", r.index, (int)mode);
    write_through_locked(line);
    RET(NVML_SUCCESS);
}
