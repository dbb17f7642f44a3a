/* Event sets (nvmlEventSet*) and the runtime control entry points (mocknvml_*). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mocknvml.h"
#include "state.h"

nvmlDevice_t mock_gpu_handle(unsigned gpu);

struct nvmlEventSet_st {
    int live;
    unsigned long long mask[MOCK_MAX_GPUS];   /* registered event types per GPU */
    unsigned head, count;
    struct { unsigned gpu; mock_event ev; } queue[MOCK_MAX_EVENTS];
};

static struct nvmlEventSet_st *g_sets[MOCK_MAX_SETS];
pthread_cond_t g_mock_cond;
static pthread_once_t g_cond_once = PTHREAD_ONCE_INIT;

static void cond_init(void) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g_mock_cond, &a);
    pthread_condattr_destroy(&a);
}

/* A new init starts with no registrations: the sets of an earlier session keep their memory (so a stale
 * handle is still detected) but stop receiving events. */
void mock_events_reset_locked(void) {
    pthread_once(&g_cond_once, cond_init);
    for (unsigned k = 0; k < MOCK_MAX_SETS; k++) {
        if (!g_sets[k]) continue;
        memset(g_sets[k]->mask, 0, sizeof g_sets[k]->mask);
        g_sets[k]->head = g_sets[k]->count = 0;
    }
}

static int set_valid(nvmlEventSet_t set) {
    if (!set) return 0;
    for (unsigned k = 0; k < MOCK_MAX_SETS; k++)
        if (g_sets[k] == set && set->live) return 1;
    return 0;
}

static void push(struct nvmlEventSet_st *s, unsigned gpu, const mock_event *ev) {
    if (s->count == MOCK_MAX_EVENTS) { s->head = (s->head + 1) % MOCK_MAX_EVENTS; s->count--; } /* drop oldest */
    unsigned slot = (s->head + s->count) % MOCK_MAX_EVENTS;
    s->queue[slot].gpu = gpu;
    s->queue[slot].ev = *ev;
    s->count++;
}

#define LOCK() do { pthread_mutex_lock(&g_mock_lock); mock_poll_control_locked(&g_mock); } while (0)
#define RET(x) do { nvmlReturn_t r_ = (x); pthread_mutex_unlock(&g_mock_lock); return r_; } while (0)

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    LOCK();
    if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
    if (!set) RET(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned k = 0; k < MOCK_MAX_SETS; k++) {
        if (g_sets[k] && g_sets[k]->live) continue;
        if (!g_sets[k]) g_sets[k] = calloc(1, sizeof *g_sets[k]);
        if (!g_sets[k]) RET(NVML_ERROR_MEMORY);
        memset(g_sets[k], 0, sizeof *g_sets[k]);
        g_sets[k]->live = 1;
        *set = g_sets[k];
        RET(NVML_SUCCESS);
    }
    RET(NVML_ERROR_INSUFFICIENT_RESOURCES);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    LOCK();
    if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
    if (!set_valid(set)) RET(NVML_ERROR_INVALID_ARGUMENT);
    set->live = 0; /* memory is kept and reused, so a freed handle stays detectable */
    pthread_cond_broadcast(&g_mock_cond);
    RET(NVML_SUCCESS);
}

/* gpu index of a full-GPU handle, or -1 for MIG/invalid handles (with the error to return) */
static int gpu_of(nvmlDevice_t device, nvmlReturn_t *err, const char *fn) {
    for (unsigned i = 0; i < g_mock.ngpus; i++) {
        if (mock_gpu_handle(i) != device) continue;
        mock_gpu *g = &g_mock.gpus[i];
        if (g->v.lost) { *err = NVML_ERROR_GPU_IS_LOST; return -1; }
        for (unsigned k = 0; k < g_mock.nNotSupported; k++)
            if (strcmp(g_mock.notSupported[k], fn) == 0) { *err = NVML_ERROR_NOT_SUPPORTED; return -1; }
        for (unsigned k = 0; k < g->nNotSupported; k++)
            if (strcmp(g->notSupported[k], fn) == 0) { *err = NVML_ERROR_NOT_SUPPORTED; return -1; }
        return (int)i;
    }
    /* MIG device handles are valid NVML devices but events are per GPU */
    unsigned isMig = 0;
    pthread_mutex_unlock(&g_mock_lock);
    nvmlReturn_t r = nvmlDeviceIsMigDeviceHandle(device, &isMig);
    pthread_mutex_lock(&g_mock_lock);
    *err = r != NVML_SUCCESS ? r : NVML_ERROR_NOT_SUPPORTED;
    return -1;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    LOCK();
    nvmlReturn_t err = NVML_SUCCESS;
    if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
    int gpu = gpu_of(device, &err, __func__);
    if (gpu < 0) RET(err);
    if (!eventTypes) RET(NVML_ERROR_INVALID_ARGUMENT);
    long long m = g_mock.gpus[gpu].v.supportedEvents;
    *eventTypes = (unsigned long long)(m == MOCK_ABSENT ? 0 : m);
    RET(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    LOCK();
    nvmlReturn_t err = NVML_SUCCESS;
    if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
    int gpu = gpu_of(device, &err, __func__);
    if (gpu < 0) RET(err);
    if (!set_valid(set) || eventTypes == 0) RET(NVML_ERROR_INVALID_ARGUMENT);
    mock_gpu *g = &g_mock.gpus[gpu];
    unsigned long long supported = (unsigned long long)g->v.supportedEvents;
    if (eventTypes & ~supported) RET(NVML_ERROR_NOT_SUPPORTED);
    set->mask[gpu] |= eventTypes;
    /* events queued for this GPU move to the first set that registers for them */
    unsigned keep = 0;
    for (unsigned k = 0; k < g->nPending; k++) {
        if (g->pending[k].type & eventTypes) push(set, (unsigned)gpu, &g->pending[k]);
        else g->pending[keep++] = g->pending[k];
    }
    g->nPending = keep;
    pthread_cond_broadcast(&g_mock_cond);
    RET(NVML_SUCCESS);
}

static int set_has_lost_gpu(const struct nvmlEventSet_st *s) {
    for (unsigned i = 0; i < g_mock.ngpus; i++)
        if (s->mask[i] && g_mock.gpus[i].v.lost) return 1;
    return 0;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    LOCK();
    if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
    if (!set_valid(set) || !data) RET(NVML_ERROR_INVALID_ARGUMENT);
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeoutms / 1000;
    deadline.tv_nsec += (long)(timeoutms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) { deadline.tv_sec++; deadline.tv_nsec -= 1000000000L; }
    for (;;) {
        if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
        if (!set->live) RET(NVML_ERROR_INVALID_ARGUMENT);
        if (set->count) {
            unsigned slot = set->head;
            set->head = (set->head + 1) % MOCK_MAX_EVENTS;
            set->count--;
            data->device = mock_gpu_handle(set->queue[slot].gpu);
            data->eventType = set->queue[slot].ev.type;
            data->eventData = set->queue[slot].ev.data;
            data->gpuInstanceId = set->queue[slot].ev.gi;
            data->computeInstanceId = set->queue[slot].ev.ci;
            RET(NVML_SUCCESS);
        }
        if (set_has_lost_gpu(set)) RET(NVML_ERROR_GPU_IS_LOST);
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > deadline.tv_sec || (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec))
            RET(NVML_ERROR_TIMEOUT);
        struct timespec until = deadline;
        if (g_mock.controlPath[0]) { /* poll the control file every 10 ms while waiting */
            until = now;
            until.tv_nsec += 10000000L;
            if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
            if (until.tv_sec > deadline.tv_sec || (until.tv_sec == deadline.tv_sec && until.tv_nsec > deadline.tv_nsec))
                until = deadline;
        }
        pthread_cond_timedwait(&g_mock_cond, &g_mock_lock, &until);
        mock_poll_control_locked(&g_mock);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Runtime control
 */
int mock_inject_event_locked(mock_state *st, unsigned gpu, unsigned long long type, unsigned long long data,
                             unsigned gi, unsigned ci) {
    if (gpu >= st->ngpus || type == 0) return NVML_ERROR_INVALID_ARGUMENT;
    mock_event ev = {type, data, gi, ci};
    int delivered = 0;
    for (unsigned k = 0; k < MOCK_MAX_SETS; k++) {
        struct nvmlEventSet_st *s = g_sets[k];
        if (s && s->live && (s->mask[gpu] & type)) { push(s, gpu, &ev); delivered = 1; }
    }
    if (!delivered) {
        mock_gpu *g = &st->gpus[gpu];
        if (g->nPending >= MOCK_MAX_EVENTS) return NVML_ERROR_INSUFFICIENT_SIZE;
        g->pending[g->nPending++] = ev;
    }
    pthread_cond_broadcast(&g_mock_cond);
    return NVML_SUCCESS;
}

int mock_set_lost_locked(mock_state *st, unsigned gpu, int lost) {
    if (gpu >= st->ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    st->gpus[gpu].v.lost = lost != 0;
    pthread_cond_broadcast(&g_mock_cond);
    return NVML_SUCCESS;
}

MOCK_EXPORT int mocknvml_control(const char *command) {
    pthread_mutex_lock(&g_mock_lock);
    int r = g_mock.refcount == 0 ? NVML_ERROR_UNINITIALIZED : !command ? NVML_ERROR_INVALID_ARGUMENT
                                                                      : mock_command_locked(&g_mock, command);
    pthread_mutex_unlock(&g_mock_lock);
    return r;
}

MOCK_EXPORT int mocknvml_set_lost(unsigned gpu, int lost) {
    pthread_mutex_lock(&g_mock_lock);
    int r = g_mock.refcount == 0 ? NVML_ERROR_UNINITIALIZED : mock_set_lost_locked(&g_mock, gpu, lost);
    pthread_mutex_unlock(&g_mock_lock);
    return r;
}

MOCK_EXPORT int mocknvml_inject_event(unsigned gpu, unsigned long long type, unsigned long long data, unsigned gi,
                                      unsigned ci) {
    pthread_mutex_lock(&g_mock_lock);
    int r = g_mock.refcount == 0 ? NVML_ERROR_UNINITIALIZED : mock_inject_event_locked(&g_mock, gpu, type, data, gi, ci);
    pthread_mutex_unlock(&g_mock_lock);
    return r;
}

MOCK_EXPORT int mocknvml_set_ecc(unsigned gpu, int uncorrected, int aggregate, unsigned long long count) {
    pthread_mutex_lock(&g_mock_lock);
    int r = NVML_SUCCESS;
    if (g_mock.refcount == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (gpu >= g_mock.ngpus) r = NVML_ERROR_INVALID_ARGUMENT;
    else {
        mock_scalars *s = &g_mock.gpus[gpu].v;
        *(uncorrected ? (aggregate ? &s->eccAggUnc : &s->eccVolUnc) : (aggregate ? &s->eccAggCorr : &s->eccVolCorr)) =
            (long long)count;
    }
    pthread_mutex_unlock(&g_mock_lock);
    return r;
}
