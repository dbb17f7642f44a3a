/* Library-wide state shared by profile.c, api.c and events.c. */
#ifndef MOCKNVML_STATE_H
#define MOCKNVML_STATE_H

#include "mocknvml.h"

#define MOCK_PROFILE_ENV "DRADRIVER_MOCK_NVML_PROFILE"
#define MOCK_CONTROL_ENV "DRADRIVER_MOCK_NVML_CONTROL"
#define MOCK_STATE_ENV "DRADRIVER_MOCK_NVML_STATE"       /* MIG state file shared by processes (mig.c) */
#define MOCK_PROC_ROOT_ENV "DRADRIVER_MOCK_NVML_PROC_ROOT" /* procfs root for MIG capability files (mig.c) */
#define MOCK_SYSFS_ENV "DRADRIVER_MOCK_NVML_SYSFS"     /* sysfs root: list only GPUs bound to nvidia (api.c) */
#define MOCK_MAX_FAULTS 64

/* A return-code override from the "fail" command (mig.c): calls of `fn` on GPU `gpu` (-1: any) return `rc`;
 * rc MOCK_FAULT_KILL raises SIGKILL at entry, MOCK_FAULT_KILL_AFTER once the call's effect is done. */
#define MOCK_FAULT_KILL (-9)
#define MOCK_FAULT_KILL_AFTER (-10)
typedef struct {
    int gpu, rc, count; /* count: calls left to fail, -1 = every call */
    char fn[64];
} mock_fault;

typedef struct {
    unsigned refcount;               /* nvmlInit/nvmlShutdown reference count; 0 = uninitialized */
    char driverVersion[80], nvmlVersion[80];
    long long cudaDriverVersion;
    int initReturn;
    int driverGone;                  /* control "driver unloaded [rc]": what every call returns; 0 = loaded */
    unsigned ngpus;
    mock_gpu gpus[MOCK_MAX_GPUS];
    unsigned nNotSupported;
    char notSupported[MOCK_MAX_NAMES][64];
    char controlPath[4096];
    long long controlOffset;
    long long initMonotonicUs;
    unsigned nFaults;
    mock_fault faults[MOCK_MAX_FAULTS];
    char statePath[4096], procRoot[4096];
    long long stateMtimeNs, stateSize, stateIno; /* the state file as last read or written */
} mock_state;

/* Why an entry point cannot run now: not initialised (UNINITIALIZED), or the driver unloaded under the running
 * library (control "driver unloaded"); 0 when it can. */
static inline int mock_unusable(const mock_state *st) { return st->refcount == 0 ? NVML_ERROR_UNINITIALIZED : st->driverGone; }

typedef struct {
    unsigned index;
    mock_gpu *g;
    int mig;             /* 1 for a MIG device handle */
    mock_gi *gi;         /* MIG only */
    mock_ci *ci;         /* MIG only */
} dev_ref;

typedef struct {
    unsigned gpu;
    mock_gpu *g;
    mock_gi *gi;
    const mock_gi_profile *gp;
} gi_ref;

extern mock_state g_mock;
extern pthread_mutex_t g_mock_lock;
extern pthread_cond_t g_mock_cond;

int mock_load_profile(mock_state *st, char *msg, size_t msglen);
int mock_parse_bus_id(const char *s, unsigned *domain, unsigned *bus, unsigned *device);
const mock_gi_profile *mock_gi_profile_by_id(const mock_gpu *g, unsigned id);
const mock_ci_profile *mock_ci_profile_by_id(const mock_gi_profile *p, unsigned id);
int mock_command_locked(mock_state *st, const char *line);
void mock_poll_control_locked(mock_state *st);
int mock_set_lost_locked(mock_state *st, unsigned gpu, int lost);
int mock_inject_event_locked(mock_state *st, unsigned gpu, unsigned long long type, unsigned long long data,
                             unsigned gi, unsigned ci);
void mock_events_reset_locked(void);

/* api.c: handle tables and the checks every entry point makes */
nvmlReturn_t mock_enter_dev(const char *fn, nvmlDevice_t h, dev_ref *r, int allow_mig);
nvmlReturn_t mock_enter_gi(const char *fn, nvmlGpuInstance_t h, gi_ref *r);
nvmlGpuInstance_t mock_gi_handle(unsigned gpu, unsigned gi);
nvmlComputeInstance_t mock_ci_handle(unsigned gpu, unsigned gi, unsigned ci);
int mock_ci_handle_ref(nvmlComputeInstance_t h, unsigned *gpu, unsigned *gi, unsigned *ci);
nvmlDevice_t mock_mig_handle(unsigned gpu, unsigned gi, unsigned ci);

/* mig.c: faults, MIG mutations, the shared state file and capability files */
int mock_fault_locked(mock_state *st, const char *fn, int gpu); /* NVML_SUCCESS or the overriding code */
void mock_fault_after_locked(mock_state *st, const char *fn, int gpu);
int mock_mig_command_locked(mock_state *st, const char *verb, int n, const char *a, const char *b, const char *c,
                            const char *d, const char *e);
void mock_mig_init_locked(mock_state *st);
void mock_mig_poll_locked(mock_state *st);
typedef dev_ref mock_dev_ref; /* settings.c's name for it */
int mock_set_mig_compute_mode_locked(mock_state *st, unsigned gpu, unsigned gi, unsigned ci, long long mode);

#endif
