/* Library-wide state shared by profile.c, api.c and events.c. */
#ifndef MOCKNVML_STATE_H
#define MOCKNVML_STATE_H

#include "mocknvml.h"

#define MOCK_PROFILE_ENV "DRADRIVER_MOCK_NVML_PROFILE"
#define MOCK_CONTROL_ENV "DRADRIVER_MOCK_NVML_CONTROL"

typedef struct {
    unsigned refcount;               /* nvmlInit/nvmlShutdown reference count; 0 = uninitialized */
    char driverVersion[80], nvmlVersion[80];
    long long cudaDriverVersion;
    int initReturn;
    unsigned ngpus;
    mock_gpu gpus[MOCK_MAX_GPUS];
    unsigned nNotSupported;
    char notSupported[MOCK_MAX_NAMES][64];
    char controlPath[4096];
    long long controlOffset;
    long long initMonotonicUs;
} mock_state;

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

/* A device handle resolved by api.c (shared with settings.c). */
typedef struct {
    unsigned index;
    mock_gpu *g;
    int mig;             /* 1 for a MIG device handle */
    mock_gi *gi;         /* MIG only */
    mock_ci *ci;         /* MIG only */
} mock_dev_ref;
nvmlReturn_t mock_enter_dev(const char *fn, nvmlDevice_t h, mock_dev_ref *r, int allow_mig);
int mock_set_mig_compute_mode_locked(mock_state *st, unsigned gpu, unsigned gi, unsigned ci, long long mode);

#endif
