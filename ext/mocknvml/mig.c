/* MIG mutations of the mock: MIG mode changes, GPU/compute instance create and destroy, processes that make an
 * instance "in use", return-code overrides ("fail" command), the state file that lets several processes share one
 * emulated GPU (and outlive a SIGKILL), and the capability files under a procfs root.
 *
 * Return codes follow nvml.h's documentation of each entry point:
 * - nvmlDeviceSetMigMode: INVALID_ARGUMENT (bad mode/pointer), NOT_SUPPORTED (not MIG capable); an activation that
 *   cannot happen now is reported in *activationStatus (NVML_ERROR_IN_USE: "device isn't idle"), the mode stays
 *   pending. Ampere (architecture < Hopper) always stays pending until a GPU reset (the "reset" command), as MIG
 *   mode changes there need one; Hopper and newer apply at once when idle (no processes, no GPU instance left
 *   when disabling).
 * - Create*: NOT_SUPPORTED (MIG off), INVALID_ARGUMENT (unknown profile, impossible placement, NULL),
 *   INSUFFICIENT_RESOURCES (placement occupied, profile instance count reached, no compute slices left).
 * - Destroy: IN_USE when processes run on the instance, or (GI) compute instances still exist.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mocknvml.h"
#include "state.h"

#define LOCK() do { pthread_mutex_lock(&g_mock_lock); mock_poll_control_locked(&g_mock); mock_mig_poll_locked(&g_mock); } while (0)
#define RET(x) do { nvmlReturn_t r_ = (x); pthread_mutex_unlock(&g_mock_lock); return r_; } while (0)
#define DEV_ENTER(h, ref, allow_mig)                                                                          \
    dev_ref ref;                                                                                              \
    LOCK();                                                                                                   \
    do { nvmlReturn_t e_ = mock_enter_dev(__func__, (h), &ref, (allow_mig)); if (e_ != NVML_SUCCESS) RET(e_); } while (0)
#define GI_ENTER(h, ref)                                                                                      \
    gi_ref ref;                                                                                               \
    LOCK();                                                                                                   \
    do { nvmlReturn_t e_ = mock_enter_gi(__func__, (h), &ref); if (e_ != NVML_SUCCESS) RET(e_); } while (0)

#define ARCH_HOPPER 9 /* NVML_DEVICE_ARCH_HOPPER */
#define NO_ID 0xFFFFFFFFu

/* ---------------------------------------------------------------------------------------------------------
 * Return-code overrides: "fail <gpu|*> <function> <rc|kill|killafter> [<count>]"
 */
int mock_fault_locked(mock_state *st, const char *fn, int gpu) {
    for (unsigned k = 0; k < st->nFaults; k++) {
        mock_fault *f = &st->faults[k];
        if (f->count == 0 || f->rc == MOCK_FAULT_KILL_AFTER || strcmp(f->fn, fn) != 0) continue;
        if (f->gpu >= 0 && f->gpu != gpu) continue;
        if (f->count > 0) f->count--;
        if (f->rc == MOCK_FAULT_KILL) raise(SIGKILL);
        return f->rc;
    }
    return NVML_SUCCESS;
}

void mock_fault_after_locked(mock_state *st, const char *fn, int gpu) {
    for (unsigned k = 0; k < st->nFaults; k++) {
        mock_fault *f = &st->faults[k];
        if (f->count == 0 || f->rc != MOCK_FAULT_KILL_AFTER || strcmp(f->fn, fn) != 0) continue;
        if (f->gpu >= 0 && f->gpu != gpu) continue;
        raise(SIGKILL);
    }
}

static int set_fault(mock_state *st, int gpu, const char *fn, int rc, int count) {
    for (unsigned k = 0; k < st->nFaults; k++) {
        if (st->faults[k].gpu == gpu && strcmp(st->faults[k].fn, fn) == 0) {
            if (rc == 0) {
                memmove(&st->faults[k], &st->faults[k + 1], (st->nFaults - k - 1) * sizeof st->faults[0]);
                st->nFaults--;
            } else {
                st->faults[k].rc = rc;
                st->faults[k].count = count;
            }
            return NVML_SUCCESS;
        }
    }
    if (rc == 0) return NVML_SUCCESS;
    if (st->nFaults >= MOCK_MAX_FAULTS) return NVML_ERROR_INSUFFICIENT_SIZE;
    mock_fault *f = &st->faults[st->nFaults++];
    f->gpu = gpu;
    f->rc = rc;
    f->count = count;
    snprintf(f->fn, sizeof f->fn, "%s", fn);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * Capability files: <procRoot>/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>[/ci<c>]/access appear and vanish
 * with the instances; <procRoot>/driver/nvidia-caps/mig-minors lists every possible capability (NVIDIA's MIG User
   Guide, "Device Nodes and Capabilities").
 */
static unsigned cap_minor(unsigned gpu_minor, unsigned gi, int ci) {
    return 3 + 135 * gpu_minor + 9 * gi + (ci < 0 ? 0 : 1 + (unsigned)ci);
}

static void mkdirs(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        mkdir(buf, 0755);
        *p = '/';
    }
    mkdir(buf, 0755);
}

/* Create dir/name with text unless it exists (capability files never change while they exist). */
static void write_file(const char *dir, const char *name, const char *text) {
    char path[4200], tmp[4300];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (stat(path, &sb) == 0) return;
    if (stat(dir, &sb) != 0) mkdirs(dir);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fputs(text, f);
    fclose(f);
    rename(tmp, path);
}

static void cap_text(char *buf, size_t n, unsigned minor) {
    snprintf(buf, n, "DeviceFileMinor: %u\nDeviceFileMode: 292\nDeviceFileModify: 1\n", minor);
}

/* Bring the capability files of GPU instance `only` (-1: every GI) of `gpu` in line with its instances. */
static void sync_caps_locked(mock_state *st, unsigned gpu, int only) {
    if (!st->procRoot[0]) return;
    const mock_gpu *g = &st->gpus[gpu];
    if (!g->v.migCapable || g->v.minorNumber < 0) return;
    unsigned minor = (unsigned)g->v.minorNumber;
    char dir[4200], file[4400], text[128];
    for (unsigned gi = 0; gi < MOCK_MAX_GI; gi++) {
        if (only >= 0 && gi != (unsigned)only) continue;
        const mock_gi *x = &g->gi[gi];
        int live = g->v.migCurrent == 1 && x->exists;
        snprintf(dir, sizeof dir, "%s/driver/nvidia/capabilities/gpu%u/mig/gi%u", st->procRoot, minor, gi);
        for (unsigned ci = 0; ci < MOCK_MAX_CI; ci++) {
            char cidir[4300];
            snprintf(cidir, sizeof cidir, "%s/ci%u", dir, ci);
            if (live && x->ci[ci].exists) {
                cap_text(text, sizeof text, cap_minor(minor, gi, (int)ci));
                write_file(cidir, "access", text);
            } else {
                snprintf(file, sizeof file, "%s/access", cidir);
                unlink(file);
                rmdir(cidir);
            }
        }
        if (live) {
            cap_text(text, sizeof text, cap_minor(minor, gi, -1));
            write_file(dir, "access", text);
        } else {
            snprintf(file, sizeof file, "%s/access", dir);
            unlink(file);
            rmdir(dir);
        }
    }
}

static void write_static_caps_locked(mock_state *st) {
    if (!st->procRoot[0]) return;
    char dir[4200], text[128];
    size_t cap = 32 * MOCK_MAX_GI * (1 + MOCK_MAX_CI) * 32 + 64;
    char *minors = malloc(cap);
    if (!minors) return;
    size_t len = (size_t)snprintf(minors, cap, "config 1\nmonitor 2\n");
    for (unsigned g = 0; g < 32; g++)
        for (unsigned gi = 0; gi < MOCK_MAX_GI; gi++) {
            len += (size_t)snprintf(minors + len, cap - len, "gpu%u/gi%u/access %u\n", g, gi, cap_minor(g, gi, -1));
            for (unsigned ci = 0; ci < MOCK_MAX_CI; ci++)
                len += (size_t)snprintf(minors + len, cap - len, "gpu%u/gi%u/ci%u/access %u\n", g, gi, ci,
                                        cap_minor(g, gi, (int)ci));
        }
    snprintf(dir, sizeof dir, "%s/driver/nvidia-caps", st->procRoot);
    write_file(dir, "mig-minors", minors);
    free(minors);
    snprintf(dir, sizeof dir, "%s/driver/nvidia/capabilities/mig", st->procRoot);
    snprintf(text, sizeof text, "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n");
    write_file(dir, "config", text);
    snprintf(text, sizeof text, "DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n");
    write_file(dir, "monitor", text);
}

/* ---------------------------------------------------------------------------------------------------------
 * The state file: MIG mode, instances and processes of every GPU, rewritten (atomically) after each change and
 * re-read when another process changed it. Lines:
 *   gpu <index> <migCurrent> <migPending> <procs>
 *   gi <index> <id> <profileId> <start> <size>
 *   ci <index> <gi id> <ci id> <profileId> <start> <size> <procs> <uuid> <name...>
 * ci lines are in MIG device index order.
 */
static void note_state_file(mock_state *st) {
    struct stat sb;
    if (stat(st->statePath, &sb) == 0) {
        st->stateMtimeNs = (long long)sb.st_mtim.tv_sec * 1000000000LL + sb.st_mtim.tv_nsec;
        st->stateSize = (long long)sb.st_size;
        st->stateIno = (long long)sb.st_ino;
    } else {
        st->stateMtimeNs = st->stateSize = st->stateIno = -1;
    }
}

/* Rewritten in place under an exclusive flock (readers take a shared one): a rename or a truncate to zero over the
 * old file would make ext4 flush it (auto_da_alloc), costing milliseconds per NVML call on a busy disk. */
static void write_state_locked(mock_state *st) {
    if (!st->statePath[0]) return;
    size_t cap = 4096 + (size_t)st->ngpus * (64 + MOCK_MAX_GI * 48 + MOCK_MAX_MIG * 240), len = 0;
    char *buf = malloc(cap);
    if (!buf) return;
#define PUT(...) do { int n_ = snprintf(buf + len, cap - len, __VA_ARGS__); if (n_ > 0) len += (size_t)n_; } while (0)
    PUT("# mocknvml MIG state, format 1\n");
    for (unsigned k = 0; k < st->ngpus && len < cap; k++) {
        const mock_gpu *g = &st->gpus[k];
        PUT("gpu %u %lld %lld %u\n", k, g->v.migCurrent, g->v.migPending, g->procs);
        for (unsigned gi = 0; gi < MOCK_MAX_GI && len < cap; gi++) {
            const mock_gi *x = &g->gi[gi];
            if (x->exists) PUT("gi %u %u %u %u %u\n", k, x->id, x->profileId, x->placement.start, x->placement.size);
        }
        for (unsigned m = 0; m < g->nmig && len < cap; m++) {
            const mock_ci *c = &g->gi[g->migGi[m]].ci[g->migCi[m]];
            PUT("ci %u %u %u %u %u %u %u %s %s\n", k, g->migGi[m], c->id, c->profileId, c->placement.start,
                c->placement.size, c->procs, c->uuid, c->name);
        }
    }
#undef PUT
    if (len > cap) len = cap;
    int fd = open(st->statePath, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) { fprintf(stderr, "mocknvml: cannot write %s: %s\n", st->statePath, strerror(errno)); free(buf); return; }
    flock(fd, LOCK_EX);
    size_t done = 0;
    while (done < len) {
        ssize_t w = pwrite(fd, buf + done, len - done, (off_t)done);
        if (w <= 0) break;
        done += (size_t)w;
    }
    if (done != len || ftruncate(fd, (off_t)len) != 0)
        fprintf(stderr, "mocknvml: cannot write %s: %s\n", st->statePath, strerror(errno));
    flock(fd, LOCK_UN);
    close(fd);
    free(buf);
    note_state_file(st);
}

static void read_state_locked(mock_state *st) {
    FILE *f = fopen(st->statePath, "r");
    if (!f) { note_state_file(st); return; }
    flock(fileno(f), LOCK_SH);
    note_state_file(st);
    char line[512];
    while (fgets(line, sizeof line, f)) {
        unsigned gpu, a, b, c2, d, e2, p;
        long long cur, pend;
        char uuid[MOCK_STR], name[MOCK_STR];
        line[strcspn(line, "\n")] = '\0';
        if (sscanf(line, "gpu %u %lld %lld %u", &gpu, &cur, &pend, &p) == 4 && gpu < st->ngpus) {
            mock_gpu *g = &st->gpus[gpu];
            g->v.migCurrent = cur;
            g->v.migPending = pend;
            g->procs = p;
            memset(g->gi, 0, sizeof g->gi);
            g->nmig = 0;
        } else if (sscanf(line, "gi %u %u %u %u %u", &gpu, &a, &b, &c2, &d) == 5 && gpu < st->ngpus && a < MOCK_MAX_GI) {
            mock_gi *x = &st->gpus[gpu].gi[a];
            memset(x, 0, sizeof *x);
            x->exists = 1;
            x->id = a;
            x->profileId = b;
            x->placement.start = c2;
            x->placement.size = d;
        } else {
            int off = 0;
            if (sscanf(line, "ci %u %u %u %u %u %u %u %95s %n", &gpu, &a, &b, &c2, &d, &e2, &p, uuid, &off) == 8 &&
                gpu < st->ngpus && a < MOCK_MAX_GI && b < MOCK_MAX_CI && st->gpus[gpu].gi[a].exists) {
                mock_gpu *g = &st->gpus[gpu];
                mock_ci *c = &g->gi[a].ci[b];
                snprintf(name, sizeof name, "%s", line + off);
                c->exists = 1;
                c->id = b;
                c->profileId = c2;
                c->placement.start = d;
                c->placement.size = e2;
                c->procs = p;
                snprintf(c->uuid, sizeof c->uuid, "%s", uuid);
                snprintf(c->name, sizeof c->name, "%s", name);
                if (g->nmig < MOCK_MAX_MIG) {
                    g->migGi[g->nmig] = (unsigned char)a;
                    g->migCi[g->nmig] = (unsigned char)b;
                    g->nmig++;
                }
            }
        }
    }
    flock(fileno(f), LOCK_UN);
    fclose(f);
}

static void changed_locked(mock_state *st, unsigned gpu, int gi) {
    write_state_locked(st);
    sync_caps_locked(st, gpu, gi);
}

void mock_mig_init_locked(mock_state *st) {
    const char *sp = getenv(MOCK_STATE_ENV), *pr = getenv(MOCK_PROC_ROOT_ENV);
    snprintf(st->statePath, sizeof st->statePath, "%s", sp ? sp : "");
    snprintf(st->procRoot, sizeof st->procRoot, "%s", pr ? pr : "");
    if (st->statePath[0]) {
        if (access(st->statePath, F_OK) == 0) read_state_locked(st);
        else write_state_locked(st);
    }
    write_static_caps_locked(st);
    for (unsigned k = 0; k < st->ngpus; k++) sync_caps_locked(st, k, -1);
}

void mock_mig_poll_locked(mock_state *st) {
    if (!st->statePath[0] || st->refcount == 0) return;
    struct stat sb;
    if (stat(st->statePath, &sb) != 0) return;
    long long mt = (long long)sb.st_mtim.tv_sec * 1000000000LL + sb.st_mtim.tv_nsec;
    if (mt == st->stateMtimeNs && (long long)sb.st_size == st->stateSize && (long long)sb.st_ino == st->stateIno) return;
    read_state_locked(st);
}

/* ---------------------------------------------------------------------------------------------------------
 * Instance bookkeeping
 */
static unsigned long long slice_bits(unsigned start, unsigned size) { return ((1ULL << size) - 1) << start; }

static unsigned long long used_memory_slices(const mock_gpu *g) {
    unsigned long long bits = 0;
    for (unsigned k = 0; k < MOCK_MAX_GI; k++)
        if (g->gi[k].exists) bits |= slice_bits(g->gi[k].placement.start, g->gi[k].placement.size);
    return bits;
}

/* GI ids come from per-size pools (MIG User Guide examples, NVIDIA/DCGM#138): 8 memory slices -> 0, 4 -> 1-2, 2 ->
3-6, 1 -> 7-14. */ static int pick_gi_id(const mock_gpu *g, unsigned size) {
    unsigned lo, hi;
    if (size >= 8) { lo = 0; hi = 0; }
    else if (size >= 4) { lo = 1; hi = 2; }
    else if (size >= 2) { lo = 3; hi = 6; }
    else { lo = 7; hi = 14; }
    for (unsigned id = lo; id <= hi && id < MOCK_MAX_GI; id++)
        if (!g->gi[id].exists) return (int)id;
    for (unsigned id = 0; id < MOCK_MAX_GI; id++) /* a pool is full: any free id (more than the pools hold) */
        if (!g->gi[id].exists) return (int)id;
    return -1;
}

static unsigned long long fnv1a(const char *s, unsigned long long h) {
    for (; *s; s++) { h ^= (unsigned char)*s; h *= 1099511628211ULL; }
    return h;
}

/* An RFC-4122 version-5-shaped MIG UUID, deterministic per (GPU, GI, CI) as real ones look (NVIDIA's MIG User Guide,
"MIG Device Names"). */ static void make_mig_uuid(const mock_gpu *g, unsigned gi, unsigned ci, char *out, size_t n) {
    char key[160];
    snprintf(key, sizeof key, "%s/%u/%u", g->uuid, gi, ci);
    unsigned long long a = fnv1a(key, 14695981039346656037ULL), b = fnv1a(key, a ^ 0x9e3779b97f4a7c15ULL);
    unsigned char u[16];
    for (int k = 0; k < 8; k++) { u[k] = (unsigned char)(a >> (8 * k)); u[8 + k] = (unsigned char)(b >> (8 * k)); }
    u[6] = (unsigned char)((u[6] & 0x0f) | 0x50);
    u[8] = (unsigned char)((u[8] & 0x3f) | 0x80);
    snprintf(out, n, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
             u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

static void drop_mig_index(mock_gpu *g, unsigned gi, unsigned ci) {
    for (unsigned m = 0; m < g->nmig; m++) {
        if (g->migGi[m] != gi || g->migCi[m] != ci) continue;
        memmove(&g->migGi[m], &g->migGi[m + 1], g->nmig - m - 1);
        memmove(&g->migCi[m], &g->migCi[m + 1], g->nmig - m - 1);
        g->nmig--;
        return;
    }
}

static unsigned gi_procs(const mock_gi *x) {
    unsigned n = 0;
    for (unsigned c = 0; c < MOCK_MAX_CI; c++) n += x->ci[c].exists ? x->ci[c].procs : 0;
    return n;
}

static unsigned gpu_procs(const mock_gpu *g) {
    unsigned n = g->procs;
    for (unsigned k = 0; k < MOCK_MAX_GI; k++) n += g->gi[k].exists ? gi_procs(&g->gi[k]) : 0;
    return n;
}

static int any_gi(const mock_gpu *g) {
    for (unsigned k = 0; k < MOCK_MAX_GI; k++)
        if (g->gi[k].exists) return 1;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * MIG mode
 */
nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus) {
    DEV_ENTER(device, r, 0);
    if (!activationStatus || mode > NVML_DEVICE_MIG_ENABLE) RET(NVML_ERROR_INVALID_ARGUMENT);
    mock_gpu *g = r.g;
    if (!g->v.migCapable) RET(NVML_ERROR_NOT_SUPPORTED);
    if ((unsigned)g->v.migCurrent == mode && (unsigned)g->v.migPending == mode) {
        *activationStatus = NVML_SUCCESS;
        RET(NVML_SUCCESS);
    }
    g->v.migPending = mode;
    int idle = gpu_procs(g) == 0 && !(mode == NVML_DEVICE_MIG_DISABLE && any_gi(g));
    if (g->v.architecture < ARCH_HOPPER || !idle) {
        *activationStatus = NVML_ERROR_IN_USE; /* pending: Ampere until a GPU reset, Hopper+ until idle */
    } else {
        g->v.migCurrent = mode;
        *activationStatus = NVML_SUCCESS;
    }
    write_state_locked(&g_mock); /* no instance exists on either side of a mode change */
    mock_fault_after_locked(&g_mock, __func__, (int)r.index);
    RET(NVML_SUCCESS);
}

/* A GPU reset ("reset <gpu>" command): the pending MIG mode takes effect; disabling drops every instance. */
static int reset_gpu_locked(mock_state *st, unsigned gpu) {
    mock_gpu *g = &st->gpus[gpu];
    if (gpu_procs(g)) return NVML_ERROR_IN_USE;
    g->v.migCurrent = g->v.migPending;
    if (g->v.migCurrent != 1) {
        memset(g->gi, 0, sizeof g->gi);
        g->nmig = 0;
    }
    changed_locked(st, gpu, -1);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------------------
 * GPU instances
 */
static nvmlReturn_t create_gi_locked(dev_ref *r, unsigned profileId, const nvmlGpuInstancePlacement_t *placement,
                                     nvmlGpuInstance_t *out) {
    mock_gpu *g = r->g;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->v.migCapable || g->v.migCurrent != 1) return NVML_ERROR_NOT_SUPPORTED;
    const mock_gi_profile *p = mock_gi_profile_by_id(g, profileId);
    if (!p) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned existing = 0;
    for (unsigned k = 0; k < MOCK_MAX_GI; k++) existing += g->gi[k].exists && g->gi[k].profileId == profileId;
    unsigned long long used = used_memory_slices(g);
    int start = -1;
    if (placement) {
        for (unsigned s = 0; s < p->nstarts; s++)
            if (p->starts[s] == placement->start) start = (int)placement->start;
        if (start < 0 || placement->size != p->placementSize) return NVML_ERROR_INVALID_ARGUMENT;
        if (used & slice_bits((unsigned)start, p->placementSize)) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    } else {
        for (unsigned s = 0; s < p->nstarts && start < 0; s++)
            if (!(used & slice_bits(p->starts[s], p->placementSize))) start = (int)p->starts[s];
        if (start < 0) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    if (existing >= p->instanceCount) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    int id = pick_gi_id(g, p->placementSize);
    if (id < 0) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    mock_gi *x = &g->gi[id];
    memset(x, 0, sizeof *x);
    x->exists = 1;
    x->id = (unsigned)id;
    x->profileId = profileId;
    x->placement.start = (unsigned)start;
    x->placement.size = p->placementSize;
    *out = mock_gi_handle(r->index, (unsigned)id);
    changed_locked(&g_mock, r->index, id);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId, nvmlGpuInstance_t *gpuInstance) {
    DEV_ENTER(device, r, 0);
    nvmlReturn_t e = create_gi_locked(&r, profileId, NULL, gpuInstance);
    if (e == NVML_SUCCESS) mock_fault_after_locked(&g_mock, __func__, (int)r.index);
    RET(e);
}

nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                      const nvmlGpuInstancePlacement_t *placement,
                                                      nvmlGpuInstance_t *gpuInstance) {
    DEV_ENTER(device, r, 0);
    if (!placement) RET(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t e = create_gi_locked(&r, profileId, placement, gpuInstance);
    if (e == NVML_SUCCESS) mock_fault_after_locked(&g_mock, __func__, (int)r.index);
    RET(e);
}

nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) {
    GI_ENTER(gpuInstance, r);
    for (unsigned c = 0; c < MOCK_MAX_CI; c++)
        if (r.gi->ci[c].exists) RET(NVML_ERROR_IN_USE); /* compute instances are active on it */
    unsigned id = r.gi->id;
    memset(r.gi, 0, sizeof *r.gi);
    changed_locked(&g_mock, r.gpu, (int)id);
    mock_fault_after_locked(&g_mock, __func__, (int)r.gpu);
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * Compute instances
 */
static nvmlReturn_t create_ci_locked(gi_ref *r, unsigned profileId, const nvmlComputeInstancePlacement_t *placement,
                                     nvmlComputeInstance_t *out) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    const mock_ci_profile *cp = mock_ci_profile_by_id(r->gp, profileId);
    if (!cp) return NVML_ERROR_NOT_SUPPORTED;
    unsigned used = 0, same = 0;
    for (unsigned c = 0; c < MOCK_MAX_CI; c++) {
        const mock_ci *x = &r->gi->ci[c];
        if (!x->exists) continue;
        used |= (unsigned)slice_bits(x->placement.start, x->placement.size);
        same += x->profileId == profileId;
    }
    if (same >= cp->instanceCount) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned slices = r->gp->sliceCount, size = cp->sliceCount;
    int start = -1;
    if (placement) {
        if (placement->size != size || placement->start + size > slices || placement->start % size)
            return NVML_ERROR_INVALID_ARGUMENT;
        if (used & (unsigned)slice_bits(placement->start, size)) return NVML_ERROR_INSUFFICIENT_RESOURCES;
        start = (int)placement->start;
    } else {
        for (unsigned s = 0; s + size <= slices && start < 0; s += size)
            if (!(used & (unsigned)slice_bits(s, size))) start = (int)s;
        if (start < 0) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    int id = -1;
    for (unsigned c = 0; c < MOCK_MAX_CI && id < 0; c++)
        if (!r->gi->ci[c].exists) id = (int)c;
    if (id < 0 || r->g->nmig >= MOCK_MAX_MIG) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    mock_ci *x = &r->gi->ci[id];
    memset(x, 0, sizeof *x);
    x->exists = 1;
    x->id = (unsigned)id;
    x->profileId = profileId;
    x->placement.start = (unsigned)start;
    x->placement.size = size;
    make_mig_uuid(r->g, r->gi->id, (unsigned)id, x->uuid, sizeof x->uuid);
    const char *pn = cp->name;
    if (strncmp(pn, "MIG ", 4) == 0) pn += 4;
    snprintf(x->name, sizeof x->name, "%.60s MIG %.30s", r->g->name, pn);
    r->g->migGi[r->g->nmig] = (unsigned char)r->gi->id;
    r->g->migCi[r->g->nmig] = (unsigned char)id;
    r->g->nmig++;
    *out = mock_ci_handle(r->gpu, r->gi->id, (unsigned)id);
    changed_locked(&g_mock, r->gpu, (int)r->gi->id);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                  nvmlComputeInstance_t *computeInstance) {
    GI_ENTER(gpuInstance, r);
    nvmlReturn_t e = create_ci_locked(&r, profileId, NULL, computeInstance);
    if (e == NVML_SUCCESS) mock_fault_after_locked(&g_mock, __func__, (int)r.gpu);
    RET(e);
}

nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                               const nvmlComputeInstancePlacement_t *placement,
                                                               nvmlComputeInstance_t *computeInstance) {
    GI_ENTER(gpuInstance, r);
    if (!placement) RET(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t e = create_ci_locked(&r, profileId, placement, computeInstance);
    if (e == NVML_SUCCESS) mock_fault_after_locked(&g_mock, __func__, (int)r.gpu);
    RET(e);
}

nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) {
    unsigned gpu, gi, ci;
    LOCK();
    if (mock_unusable(&g_mock)) RET((nvmlReturn_t)mock_unusable(&g_mock));
    if (!mock_ci_handle_ref(computeInstance, &gpu, &gi, &ci) || gpu >= g_mock.ngpus) RET(NVML_ERROR_INVALID_ARGUMENT);
    mock_gpu *g = &g_mock.gpus[gpu];
    if (g->v.migCurrent != 1 || !g->gi[gi].exists || !g->gi[gi].ci[ci].exists) RET(NVML_ERROR_INVALID_ARGUMENT);
    if (g->v.lost) RET(NVML_ERROR_GPU_IS_LOST);
    nvmlReturn_t fe = (nvmlReturn_t)mock_fault_locked(&g_mock, __func__, (int)gpu);
    if (fe != NVML_SUCCESS) RET(fe);
    if (g->gi[gi].ci[ci].procs) RET(NVML_ERROR_IN_USE);
    memset(&g->gi[gi].ci[ci], 0, sizeof g->gi[gi].ci[ci]);
    drop_mig_index(g, gi, ci);
    changed_locked(&g_mock, gpu, (int)gi);
    mock_fault_after_locked(&g_mock, __func__, (int)gpu);
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * Processes ("in use")
 */
static nvmlReturn_t put_procs(unsigned *count, nvmlProcessInfo_t *infos, unsigned n, unsigned base, unsigned gi,
                              unsigned ci, unsigned *k) {
    for (unsigned p = 0; p < n; p++, (*k)++) {
        if (*k >= *count || !infos) continue;
        infos[*k].pid = base + *k;
        infos[*k].usedGpuMemory = 256ULL << 20;
        infos[*k].gpuInstanceId = gi;
        infos[*k].computeInstanceId = ci;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    DEV_ENTER(device, r, 1);
    if (!infoCount) RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned base = 40000 + 1000 * r.index, k = 0;
    if (r.mig) {
        put_procs(infoCount, infos, r.ci->procs, base + 100 * r.gi->id + 10 * r.ci->id, r.gi->id, r.ci->id, &k);
    } else {
        put_procs(infoCount, infos, r.g->procs, base, NO_ID, NO_ID, &k);
        for (unsigned gi = 0; gi < MOCK_MAX_GI; gi++)
            for (unsigned ci = 0; r.g->gi[gi].exists && ci < MOCK_MAX_CI; ci++)
                if (r.g->gi[gi].ci[ci].exists)
                    put_procs(infoCount, infos, r.g->gi[gi].ci[ci].procs, base + 100 * gi + 10 * ci, gi, ci, &k);
    }
    if (k > *infoCount || (k && !infos)) { *infoCount = k; RET(NVML_ERROR_INSUFFICIENT_SIZE); }
    *infoCount = k;
    RET(NVML_SUCCESS);
}

/* ---------------------------------------------------------------------------------------------------------
 * Control commands (README "Runtime control"): returns -1 for a verb that is not one of these.
 *   fail <gpu|*> <function> <rc|kill|killafter> [<count>]
 *   reset <gpu>
 *   procs <gpu> <count>                     processes on the full GPU
 *   procs <gpu> <gi> <ci> <count>           processes on one MIG device
 */
int mock_mig_command_locked(mock_state *st, const char *verb, int n, const char *a, const char *b, const char *c,
                            const char *d, const char *e) {
    (void)e;
    if (strcmp(verb, "fail") == 0 && (n == 4 || n == 5)) {
        int gpu = -1;
        if (strcmp(a, "*") != 0) {
            char *end = NULL;
            unsigned long v = strtoul(a, &end, 10);
            if (!end || *end || v >= st->ngpus) return NVML_ERROR_INVALID_ARGUMENT;
            gpu = (int)v;
        }
        int rc;
        if (strcmp(c, "kill") == 0) rc = MOCK_FAULT_KILL;
        else if (strcmp(c, "killafter") == 0) rc = MOCK_FAULT_KILL_AFTER;
        else rc = (int)strtol(c, NULL, 0);
        int count = n == 5 ? atoi(d) : -1;
        return set_fault(st, gpu, b, rc, count);
    }
    if (strcmp(verb, "reset") != 0 && strcmp(verb, "procs") != 0) return -1;
    char *end = NULL;
    unsigned long gpu = strtoul(a, &end, 10);
    if (n < 2 || !end || *end || gpu >= st->ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    mock_gpu *g = &st->gpus[gpu];
    if (strcmp(verb, "reset") == 0 && n == 2) return reset_gpu_locked(st, (unsigned)gpu);
    if (strcmp(verb, "procs") == 0 && n == 3) {
        g->procs = (unsigned)strtoul(b, NULL, 10);
        write_state_locked(st);
        return NVML_SUCCESS;
    }
    if (strcmp(verb, "procs") == 0 && n == 5) {
        unsigned gi = (unsigned)strtoul(b, NULL, 10), ci = (unsigned)strtoul(c, NULL, 10);
        if (gi >= MOCK_MAX_GI || ci >= MOCK_MAX_CI || !g->gi[gi].exists || !g->gi[gi].ci[ci].exists)
            return NVML_ERROR_NOT_FOUND;
        g->gi[gi].ci[ci].procs = (unsigned)strtoul(d, NULL, 10);
        write_state_locked(st);
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}
