/* Profile loading: JSON file -> mock_state, plus the runtime control commands. */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "mocknvml.h"
#include "state.h"

#define K(name, field) {name, offsetof(mock_scalars, field)}
const mock_scalar_key mock_scalar_keys[] = {
    K("brand", brand), K("architecture", architecture),
    K("cudaComputeCapability.major", ccMajor), K("cudaComputeCapability.minor", ccMinor),
    K("pciDeviceId", pciDeviceId), K("pciSubSystemId", pciSubSystemId), K("minorNumber", minorNumber),
    K("numaNode", numaNode), K("boardId", boardId), K("multiprocessorCount", multiprocessorCount),
    K("memory.total", memTotal), K("memory.reserved", memReserved), K("memory.used", memUsed),
    K("bar1Total", bar1Total), K("migCapable", migCapable), K("migMode.current", migCurrent),
    K("migMode.pending", migPending), K("maxMigDeviceCount", maxMigDeviceCount),
    K("power.usage", powerUsage), K("power.limit", powerLimit), K("power.minLimit", powerMinLimit),
    K("power.maxLimit", powerMaxLimit), K("temperature", temperature), K("utilization.gpu", utilGpu),
    K("utilization.memory", utilMemory),
    K("clocks.graphics", clocks[NVML_CLOCK_GRAPHICS]), K("clocks.sm", clocks[NVML_CLOCK_SM]),
    K("clocks.mem", clocks[NVML_CLOCK_MEM]), K("clocks.video", clocks[NVML_CLOCK_VIDEO]),
    K("maxClocks.graphics", maxClocks[NVML_CLOCK_GRAPHICS]), K("maxClocks.sm", maxClocks[NVML_CLOCK_SM]),
    K("maxClocks.mem", maxClocks[NVML_CLOCK_MEM]), K("maxClocks.video", maxClocks[NVML_CLOCK_VIDEO]),
    K("pcieThroughput.tx", pcieTx), K("pcieThroughput.rx", pcieRx), K("pcieMaxGen", pcieMaxGen),
    K("eccMode", eccMode),
    K("ecc.volatile.corrected", eccVolCorr), K("ecc.volatile.uncorrected", eccVolUnc),
    K("ecc.aggregate.corrected", eccAggCorr), K("ecc.aggregate.uncorrected", eccAggUnc),
    K("retiredPages.pending", retiredPending),
    K("remappedRows.corrected", remapCorr), K("remappedRows.uncorrected", remapUnc),
    K("remappedRows.pending", remapPending), K("remappedRows.failure", remapFailure),
    K("supportedEventTypes", supportedEvents), K("lost", lost), K("energy", energy),
    K("addressingMode", addressingMode), K("recoveryAction", recoveryAction),
    K("computeMode", computeMode), K("computeTimeslice", computeTimeslice), K("noPermission", noPermission),
    K("persistenceMode", persistenceMode),
    K("virtualizationMode", virtualizationMode), K("moduleId", moduleId),
    K("fabric.cliqueId", fabricCliqueId), K("fabric.state", fabricState), K("fabric.status", fabricStatus),
    K("fabric.healthMask", fabricHealthMask), K("fabric.healthSummary", fabricHealthSummary),
    {NULL, 0},
};
#undef K

long long *mock_scalar(mock_gpu *g, const char *key) {
    for (const mock_scalar_key *k = mock_scalar_keys; k->key; k++)
        if (strcmp(k->key, key) == 0) return (long long *)((char *)&g->v + k->offset);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------------------
 * Typed access to the JSON tree with error reporting ("file:line:col: message").
 */
typedef struct {
    const char *file;
    char msg[512];
    int failed;
} loadctx;

static void lerr(loadctx *c, const json_value *at, const char *fmt, ...) {
    if (c->failed) return;
    c->failed = 1;
    int k = at ? snprintf(c->msg, sizeof c->msg, "%s:%d:%d: ", c->file, at->line, at->col)
               : snprintf(c->msg, sizeof c->msg, "%s: ", c->file);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg + k, sizeof c->msg - (size_t)k, fmt, ap);
    va_end(ap);
}

/* Follow a dotted path. The first component is looked up in gpu, then in model (shallow merge). */
static const json_value *lookup(const json_value *gpu, const json_value *model, const char *path) {
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    char *save = NULL;
    char *part = strtok_r(buf, ".", &save);
    const json_value *v = json_get(gpu, part);
    if (!v) v = json_get(model, part);
    while (v && (part = strtok_r(NULL, ".", &save)) != NULL) v = json_get(v, part);
    if (v && v->type == JSON_NULL) return NULL;
    return v;
}

static int as_int(loadctx *c, const json_value *v, const char *what, long long *out) {
    if (v->type == JSON_INT || v->type == JSON_BOOL) { *out = v->i; return 1; }
    if (v->type == JSON_STRING) { /* "0x20B010DE" style hex, or a decimal string */
        char *end = NULL;
        errno = 0;
        long long x = strtoll(v->s, &end, 0);
        if (errno == 0 && end && *end == '\0' && end != v->s) { *out = x; return 1; }
    }
    lerr(c, v, "'%s' must be an integer (or a boolean / \"0x..\" string)", what);
    return 0;
}

static int opt_int(loadctx *c, const json_value *obj, const char *key, long long dflt, long long *out) {
    const json_value *v = json_get(obj, key);
    if (!v || v->type == JSON_NULL) { *out = dflt; return 1; }
    return as_int(c, v, key, out);
}

static int req_uint(loadctx *c, const json_value *obj, const char *key, unsigned *out) {
    const json_value *v = json_get(obj, key);
    long long x;
    if (!v) { lerr(c, obj, "missing required key '%s'", key); return 0; }
    if (!as_int(c, v, key, &x)) return 0;
    if (x < 0 || x > 0xFFFFFFFFLL) { lerr(c, v, "'%s' out of range", key); return 0; }
    *out = (unsigned)x;
    return 1;
}

static int copy_str(loadctx *c, const json_value *v, const char *what, char *dst, size_t cap) {
    if (v->type != JSON_STRING) { lerr(c, v, "'%s' must be a string", what); return 0; }
    if (strlen(v->s) >= cap) { lerr(c, v, "'%s' longer than %zu characters", what, cap - 1); return 0; }
    strcpy(dst, v->s);
    return 1;
}

static int name_list(loadctx *c, const json_value *v, const char *what, char (*dst)[64], unsigned *n) {
    if (!v) return 1;
    if (v->type != JSON_ARRAY) { lerr(c, v, "'%s' must be an array of function names", what); return 0; }
    for (size_t k = 0; k < v->n; k++) {
        if (*n >= MOCK_MAX_NAMES) { lerr(c, &v->items[k], "too many names in '%s'", what); return 0; }
        if (!copy_str(c, &v->items[k], what, dst[*n], 64)) return 0;
        (*n)++;
    }
    return 1;
}

int mock_parse_bus_id(const char *s, unsigned *domain, unsigned *bus, unsigned *device) {
    unsigned d = 0, b = 0, dv = 0, f = 0;
    int used = 0;
    if (sscanf(s, "%x:%x:%x.%x%n", &d, &b, &dv, &f, &used) == 4 && s[used] == '\0') {
        *domain = d; *bus = b; *device = dv;
        return 1;
    }
    return 0;
}

static int parse_uuid16(const char *s, unsigned char out[16]) {
    int n = 0;
    for (const char *p = s; *p; p++) {
        if (*p == '-') continue;
        if (!isxdigit((unsigned char)p[0]) || !isxdigit((unsigned char)p[1]) || n >= 16) return 0;
        char hx[3] = {p[0], p[1], 0};
        out[n++] = (unsigned char)strtoul(hx, NULL, 16);
        p++;
    }
    return n == 16;
}

/* ---------------------------------------------------------------------------------------------------------
 * MIG tables
 */
static int load_gi_profiles(loadctx *c, mock_gpu *g, const json_value *arr) {
    if (!arr) return 1;
    if (arr->type != JSON_ARRAY) { lerr(c, arr, "'gpuInstanceProfiles' must be an array"); return 0; }
    for (size_t k = 0; k < arr->n; k++) {
        const json_value *p = &arr->items[k];
        unsigned idx;
        long long x;
        if (p->type != JSON_OBJECT) { lerr(c, p, "GPU instance profile must be an object"); return 0; }
        if (!req_uint(c, p, "index", &idx)) return 0;
        if (idx >= NVML_GPU_INSTANCE_PROFILE_COUNT) {
            lerr(c, p, "GPU instance profile index %u >= NVML_GPU_INSTANCE_PROFILE_COUNT", idx);
            return 0;
        }
        mock_gi_profile *gp = &g->gip[idx];
        memset(gp, 0, sizeof *gp);
        gp->valid = 1;
        gp->index = idx;
        if (!req_uint(c, p, "id", &gp->id) || !req_uint(c, p, "sliceCount", &gp->sliceCount) ||
            !req_uint(c, p, "instanceCount", &gp->instanceCount) ||
            !req_uint(c, p, "multiprocessorCount", &gp->multiprocessorCount) ||
            !req_uint(c, p, "copyEngineCount", &gp->copyEngineCount) ||
            !req_uint(c, p, "decoderCount", &gp->decoderCount) ||
            !req_uint(c, p, "encoderCount", &gp->encoderCount) || !req_uint(c, p, "jpegCount", &gp->jpegCount) ||
            !req_uint(c, p, "ofaCount", &gp->ofaCount))
            return 0;
        if (!opt_int(c, p, "isP2pSupported", 0, &x)) return 0;
        gp->isP2pSupported = (unsigned)x;
        if (!opt_int(c, p, "infoReturn", 0, &x)) return 0;
        gp->infoReturn = (int)x;
        if (!opt_int(c, p, "placementsReturn", 0, &x)) return 0;
        gp->placementsReturn = (int)x;
        if (!opt_int(c, p, "memorySizeMB", -1, &x)) return 0;
        if (x < 0) { lerr(c, p, "missing required key 'memorySizeMB'"); return 0; }
        gp->memorySizeMB = (unsigned long long)x;
        const json_value *nm = json_get(p, "name");
        if (nm && !copy_str(c, nm, "name", gp->name, sizeof gp->name)) return 0;
        const json_value *pl = json_get(p, "placements");
        if (pl) {
            const json_value *starts = json_get(pl, "starts");
            if (!starts || starts->type != JSON_ARRAY || starts->n > MOCK_MAX_STARTS) {
                lerr(c, pl, "'placements.starts' must be an array of at most %d integers", MOCK_MAX_STARTS);
                return 0;
            }
            for (size_t s = 0; s < starts->n; s++) {
                if (!as_int(c, &starts->items[s], "placements.starts", &x)) return 0;
                gp->starts[gp->nstarts++] = (unsigned)x;
            }
            if (!req_uint(c, pl, "size", &gp->placementSize)) return 0;
        }
        const json_value *cips = json_get(p, "computeInstanceProfiles");
        if (cips) {
            if (cips->type != JSON_ARRAY) { lerr(c, cips, "'computeInstanceProfiles' must be an array"); return 0; }
            for (size_t s = 0; s < cips->n; s++) {
                const json_value *cp = &cips->items[s];
                unsigned cidx;
                if (!req_uint(c, cp, "index", &cidx)) return 0;
                if (cidx >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT) {
                    lerr(c, cp, "compute instance profile index %u >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT", cidx);
                    return 0;
                }
                mock_ci_profile *cq = &gp->ci[cidx];
                cq->valid = 1;
                cq->index = cidx;
                if (!opt_int(c, cp, "id", cidx, &x)) return 0;
                cq->id = (unsigned)x;
                if (!req_uint(c, cp, "sliceCount", &cq->sliceCount) ||
                    !req_uint(c, cp, "instanceCount", &cq->instanceCount) ||
                    !req_uint(c, cp, "multiprocessorCount", &cq->multiprocessorCount))
                    return 0;
                const json_value *cn = json_get(cp, "name");
                if (cn && !copy_str(c, cn, "name", cq->name, sizeof cq->name)) return 0;
            }
        }
    }
    return 1;
}

const mock_gi_profile *mock_gi_profile_by_id(const mock_gpu *g, unsigned id) {
    for (unsigned k = 0; k < NVML_GPU_INSTANCE_PROFILE_COUNT; k++)
        if (g->gip[k].valid && g->gip[k].id == id) return &g->gip[k];
    return NULL;
}

const mock_ci_profile *mock_ci_profile_by_id(const mock_gi_profile *p, unsigned id) {
    for (unsigned k = 0; k < NVML_COMPUTE_INSTANCE_PROFILE_COUNT; k++)
        if (p->ci[k].valid && p->ci[k].id == id) return &p->ci[k];
    return NULL;
}

static int place(loadctx *c, const json_value *obj, mock_place *out) {
    const json_value *pl = json_get(obj, "placement");
    if (!pl || pl->type != JSON_OBJECT) { lerr(c, obj, "missing 'placement' object {start, size}"); return 0; }
    return req_uint(c, pl, "start", &out->start) && req_uint(c, pl, "size", &out->size);
}

static int load_gpu_instances(loadctx *c, mock_gpu *g, const json_value *arr) {
    if (!arr) return 1;
    if (arr->type != JSON_ARRAY) { lerr(c, arr, "'gpuInstances' must be an array"); return 0; }
    if (arr->n && g->v.migCurrent != 1) { lerr(c, arr, "'gpuInstances' given but migMode.current is not 1"); return 0; }
    unsigned long long memUsed = 0;
    for (size_t k = 0; k < arr->n; k++) {
        const json_value *o = &arr->items[k];
        unsigned id, pid;
        if (!req_uint(c, o, "id", &id) || !req_uint(c, o, "profileId", &pid)) return 0;
        if (id >= MOCK_MAX_GI) { lerr(c, o, "GPU instance id %u out of range 0..%d", id, MOCK_MAX_GI - 1); return 0; }
        if (g->gi[id].exists) { lerr(c, o, "duplicate GPU instance id %u", id); return 0; }
        const mock_gi_profile *gp = mock_gi_profile_by_id(g, pid);
        if (!gp) { lerr(c, o, "GPU instance profileId %u is not in gpuInstanceProfiles", pid); return 0; }
        mock_gi *gi = &g->gi[id];
        memset(gi, 0, sizeof *gi);
        gi->exists = 1;
        gi->id = id;
        gi->profileId = pid;
        if (!place(c, o, &gi->placement)) return 0;
        int okStart = 0;
        for (unsigned s = 0; s < gp->nstarts; s++) okStart |= gp->starts[s] == gi->placement.start;
        if (!okStart || gi->placement.size != gp->placementSize) {
            lerr(c, o, "placement %u:%u is not a possible placement of profile %u", gi->placement.start,
                 gi->placement.size, pid);
            return 0;
        }
        unsigned long long bits = ((1ULL << gi->placement.size) - 1) << gi->placement.start;
        if (memUsed & bits) { lerr(c, o, "GPU instance %u overlaps another GPU instance", id); return 0; }
        memUsed |= bits;
        const json_value *cis = json_get(o, "computeInstances");
        if (cis && cis->type != JSON_ARRAY) { lerr(c, cis, "'computeInstances' must be an array"); return 0; }
        for (size_t s = 0; cis && s < cis->n; s++) {
            const json_value *co = &cis->items[s];
            unsigned cid, cpid;
            if (!req_uint(c, co, "id", &cid) || !req_uint(c, co, "profileId", &cpid)) return 0;
            if (cid >= MOCK_MAX_CI) { lerr(c, co, "compute instance id %u out of range", cid); return 0; }
            if (gi->ci[cid].exists) { lerr(c, co, "duplicate compute instance id %u", cid); return 0; }
            const mock_ci_profile *cp = mock_ci_profile_by_id(gp, cpid);
            if (!cp) { lerr(c, co, "compute instance profileId %u not offered by GPU instance profile %u", cpid, pid); return 0; }
            mock_ci *ci = &gi->ci[cid];
            ci->exists = 1;
            ci->id = cid;
            ci->profileId = cpid;
            if (!place(c, co, &ci->placement)) return 0;
            const json_value *u = json_get(co, "uuid");
            if (!u) { lerr(c, co, "compute instance needs a 'uuid' (MIG-...)"); return 0; }
            if (!copy_str(c, u, "uuid", ci->uuid, sizeof ci->uuid)) return 0;
            const json_value *nm = json_get(co, "name");
            if (nm) {
                if (!copy_str(c, nm, "name", ci->name, sizeof ci->name)) return 0;
            } else {
                const char *pn = cp->name;
                if (strncmp(pn, "MIG ", 4) == 0) pn += 4;
                int len = snprintf(ci->name, sizeof ci->name, "%s MIG %s", g->name, pn);
                if (len < 0 || (size_t)len >= sizeof ci->name) { lerr(c, co, "MIG device name longer than %zu characters", sizeof ci->name - 1); return 0; }
            }
            if (g->nmig >= MOCK_MAX_MIG) { lerr(c, co, "too many MIG devices"); return 0; }
            g->migGi[g->nmig] = (unsigned char)id;
            g->migCi[g->nmig] = (unsigned char)cid;
            g->nmig++;
        }
    }
    return 1;
}

static int load_events(loadctx *c, mock_gpu *g, const json_value *arr) {
    if (!arr) return 1;
    if (arr->type != JSON_ARRAY) { lerr(c, arr, "'events' must be an array"); return 0; }
    for (size_t k = 0; k < arr->n; k++) {
        const json_value *o = &arr->items[k];
        long long t, d, gi, ci;
        if (o->type != JSON_OBJECT) { lerr(c, o, "event must be an object"); return 0; }
        if (!opt_int(c, o, "eventType", -1, &t) || !opt_int(c, o, "eventData", 0, &d) ||
            !opt_int(c, o, "gpuInstanceId", 0xFFFFFFFFLL, &gi) || !opt_int(c, o, "computeInstanceId", 0xFFFFFFFFLL, &ci))
            return 0;
        if (t <= 0) { lerr(c, o, "event needs a positive 'eventType' (nvmlEventType bit, 8 = Xid)"); return 0; }
        if (g->nPending >= MOCK_MAX_EVENTS) { lerr(c, o, "too many queued events"); return 0; }
        g->pending[g->nPending++] = (mock_event){(unsigned long long)t, (unsigned long long)d, (unsigned)gi, (unsigned)ci};
    }
    return 1;
}

static int load_pages(loadctx *c, const json_value *v, unsigned long long *dst, unsigned *n) {
    if (!v) return 1;
    if (v->type != JSON_ARRAY || v->n > MOCK_MAX_PAGES) { lerr(c, v, "retired page list must be an array (at most %d)", MOCK_MAX_PAGES); return 0; }
    for (size_t k = 0; k < v->n; k++) {
        long long x;
        if (!as_int(c, &v->items[k], "retired page address", &x)) return 0;
        dst[(*n)++] = (unsigned long long)x;
    }
    return 1;
}

static int load_gpu(loadctx *c, mock_gpu *g, const json_value *gj, const json_value *models, unsigned index) {
    memset(g, 0, sizeof *g);
    if (gj->type != JSON_OBJECT) { lerr(c, gj, "gpus[%u] must be an object", index); return 0; }
    const json_value *model = NULL;
    const json_value *mn = json_get(gj, "model");
    if (mn) {
        if (mn->type != JSON_STRING) { lerr(c, mn, "'model' must be a string"); return 0; }
        model = json_get(models, mn->s);
        if (!model) { lerr(c, mn, "gpus[%u]: model '%s' is not defined in 'models'", index, mn->s); return 0; }
    }
    static const char *required[] = {"name", "uuid", "pciBusId", "minorNumber"};
    for (size_t k = 0; k < sizeof required / sizeof *required; k++)
        if (!lookup(gj, model, required[k])) { lerr(c, gj, "gpus[%u]: missing required key '%s'", index, required[k]); return 0; }
    if (!copy_str(c, lookup(gj, model, "name"), "name", g->name, sizeof g->name) ||
        !copy_str(c, lookup(gj, model, "uuid"), "uuid", g->uuid, sizeof g->uuid) ||
        !copy_str(c, lookup(gj, model, "pciBusId"), "pciBusId", g->busId, sizeof g->busId))
        return 0;
    const json_value *serial = lookup(gj, model, "serial");
    if (serial && !copy_str(c, serial, "serial", g->serial, sizeof g->serial)) return 0;
    if (!mock_parse_bus_id(g->busId, &g->domain, &g->bus, &g->device)) {
        lerr(c, lookup(gj, model, "pciBusId"), "pciBusId '%s' is not DDDDDDDD:BB:DD.F", g->busId);
        return 0;
    }
    snprintf(g->busId, sizeof g->busId, "%08X:%02X:%02X.0", g->domain, g->bus, g->device);
    snprintf(g->busIdLegacy, sizeof g->busIdLegacy, "%04X:%02X:%02X.0", g->domain & 0xFFFF, g->bus, g->device);
    for (const mock_scalar_key *k = mock_scalar_keys; k->key; k++) {
        long long *dst = (long long *)((char *)&g->v + k->offset);
        *dst = MOCK_ABSENT;
        const json_value *v = lookup(gj, model, k->key);
        if (v && !as_int(c, v, k->key, dst)) return 0;
    }
    /* defaults that make a sparse profile behave like a healthy board */
    mock_scalars *s = &g->v;
    if (s->memTotal == MOCK_ABSENT) { lerr(c, gj, "gpus[%u]: missing required key 'memory.total'", index); return 0; }
    if (s->memReserved == MOCK_ABSENT) s->memReserved = 0;
    if (s->memUsed == MOCK_ABSENT) s->memUsed = 0;
    if (s->migCapable == MOCK_ABSENT) s->migCapable = 0;
    if (s->migCurrent == MOCK_ABSENT) s->migCurrent = 0;
    if (s->migPending == MOCK_ABSENT) s->migPending = s->migCurrent;
    if (s->maxMigDeviceCount == MOCK_ABSENT) s->maxMigDeviceCount = s->migCapable ? 7 : 0;
    if (s->boardId == MOCK_ABSENT) s->boardId = ((long long)g->domain << 16) | (g->bus << 8) | g->device;
    if (s->eccMode == MOCK_ABSENT) s->eccMode = 0;
    if (s->eccVolCorr == MOCK_ABSENT) s->eccVolCorr = 0;
    if (s->eccVolUnc == MOCK_ABSENT) s->eccVolUnc = 0;
    if (s->eccAggCorr == MOCK_ABSENT) s->eccAggCorr = 0;
    if (s->eccAggUnc == MOCK_ABSENT) s->eccAggUnc = 0;
    if (s->retiredPending == MOCK_ABSENT) s->retiredPending = 0;
    if (s->remapCorr == MOCK_ABSENT) s->remapCorr = 0;
    if (s->remapUnc == MOCK_ABSENT) s->remapUnc = 0;
    if (s->remapPending == MOCK_ABSENT) s->remapPending = 0;
    if (s->remapFailure == MOCK_ABSENT) s->remapFailure = 0;
    if (s->supportedEvents == MOCK_ABSENT) s->supportedEvents = 0;
    if (s->lost == MOCK_ABSENT) s->lost = 0;
    if (s->computeMode == MOCK_ABSENT) s->computeMode = NVML_COMPUTEMODE_DEFAULT;
    if (s->computeTimeslice == MOCK_ABSENT) s->computeTimeslice = 0;
    if (s->noPermission == MOCK_ABSENT) s->noPermission = 0;
    if (s->persistenceMode == MOCK_ABSENT) s->persistenceMode = NVML_FEATURE_ENABLED;
    if (!s->migCapable && s->migCurrent) { lerr(c, gj, "gpus[%u]: migMode.current is 1 but migCapable is false", index); return 0; }
    if (s->memReserved + s->memUsed > s->memTotal) { lerr(c, gj, "gpus[%u]: memory.reserved + memory.used > memory.total", index); return 0; }
    const json_value *fab = lookup(gj, model, "fabric");
    if (fab) {
        const json_value *cu = json_get(fab, "clusterUuid");
        if (fab->type != JSON_OBJECT || !cu || cu->type != JSON_STRING || !parse_uuid16(cu->s, g->clusterUuid)) {
            lerr(c, fab, "'fabric' needs 'clusterUuid' as 32 hex digits (8-4-4-4-12)");
            return 0;
        }
        g->hasFabric = 1;
        if (s->fabricCliqueId == MOCK_ABSENT) s->fabricCliqueId = 0;
        if (s->fabricState == MOCK_ABSENT) s->fabricState = NVML_GPU_FABRIC_STATE_COMPLETED;
        if (s->fabricStatus == MOCK_ABSENT) s->fabricStatus = NVML_SUCCESS;
        if (s->fabricHealthMask == MOCK_ABSENT) s->fabricHealthMask = 0;
        if (s->fabricHealthSummary == MOCK_ABSENT) s->fabricHealthSummary = 0;
    }
    if (!load_pages(c, lookup(gj, model, "retiredPages.singleBitEcc"), g->sbePages, &g->nSbePages) ||
        !load_pages(c, lookup(gj, model, "retiredPages.doubleBitEcc"), g->dbePages, &g->nDbePages))
        return 0;
    if (!name_list(c, lookup(gj, model, "notSupported"), "notSupported", g->notSupported, &g->nNotSupported)) return 0;
    if (!load_gi_profiles(c, g, lookup(gj, model, "gpuInstanceProfiles"))) return 0;
    if (!load_gpu_instances(c, g, lookup(gj, model, "gpuInstances"))) return 0;
    if (!load_events(c, g, lookup(gj, model, "events"))) return 0;
    return 1;
}

static int load_tree(loadctx *c, mock_state *st, const json_value *root) {
    if (root->type != JSON_OBJECT) { lerr(c, root, "top level must be an object"); return 0; }
    long long fmt;
    if (!opt_int(c, root, "format", -1, &fmt)) return 0;
    if (fmt != 1) { lerr(c, root, "'format' must be 1 (this library reads profile format 1)"); return 0; }
    const json_value *sys = json_get(root, "system");
    if (!sys || sys->type != JSON_OBJECT) { lerr(c, root, "missing 'system' object"); return 0; }
    const json_value *dv = json_get(sys, "driverVersion"), *nv = json_get(sys, "nvmlVersion");
    if (!dv || !copy_str(c, dv, "system.driverVersion", st->driverVersion, sizeof st->driverVersion)) {
        if (!dv) lerr(c, sys, "missing 'system.driverVersion'");
        return 0;
    }
    if (nv) {
        if (!copy_str(c, nv, "system.nvmlVersion", st->nvmlVersion, sizeof st->nvmlVersion)) return 0;
    } else {
        snprintf(st->nvmlVersion, sizeof st->nvmlVersion, "%s", st->driverVersion);
    }
    if (!opt_int(c, sys, "cudaDriverVersion", -1, &st->cudaDriverVersion)) return 0;
    const json_value *faults = json_get(root, "faults");
    long long ir = 0;
    if (faults && !opt_int(c, faults, "initReturn", 0, &ir)) return 0;
    st->initReturn = (int)ir;
    if (faults && !name_list(c, json_get(faults, "notSupported"), "faults.notSupported", st->notSupported, &st->nNotSupported))
        return 0;
    const json_value *models = json_get(root, "models");
    if (models && models->type != JSON_OBJECT) { lerr(c, models, "'models' must be an object"); return 0; }
    const json_value *gpus = json_get(root, "gpus");
    if (!gpus || gpus->type != JSON_ARRAY) { lerr(c, root, "missing 'gpus' array"); return 0; }
    if (gpus->n > MOCK_MAX_GPUS) { lerr(c, gpus, "more than %d GPUs", MOCK_MAX_GPUS); return 0; }
    for (size_t k = 0; k < gpus->n; k++) {
        if (!load_gpu(c, &st->gpus[k], &gpus->items[k], models, (unsigned)k)) return 0;
        for (size_t j = 0; j < k; j++) {
            if (strcmp(st->gpus[j].uuid, st->gpus[k].uuid) == 0) { lerr(c, &gpus->items[k], "duplicate uuid %s", st->gpus[k].uuid); return 0; }
            if (strcmp(st->gpus[j].busId, st->gpus[k].busId) == 0) { lerr(c, &gpus->items[k], "duplicate pciBusId %s", st->gpus[k].busId); return 0; }
        }
    }
    st->ngpus = (unsigned)gpus->n;
    return 1;
}

int mock_load_profile(mock_state *st, char *msg, size_t msglen) {
    const char *path = getenv(MOCK_PROFILE_ENV);
    loadctx c = {path ? path : "(unset)", {0}, 0};
    if (!path || !*path) {
        snprintf(msg, msglen, "%s is not set; it must name a mock NVML profile (JSON file)", MOCK_PROFILE_ENV);
        return 0;
    }
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(msg, msglen, "%s: cannot open: %s", path, strerror(errno)); return 0; }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 65536 > cap) {
            cap = cap ? cap * 2 : 131072;
            char *nb = realloc(buf, cap);
            if (!nb) { free(buf); fclose(f); snprintf(msg, msglen, "%s: out of memory", path); return 0; }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    int rerr = ferror(f);
    fclose(f);
    if (rerr) { free(buf); snprintf(msg, msglen, "%s: read error", path); return 0; }
    char jerr[256];
    json_value *root = json_parse(buf, len, jerr, sizeof jerr);
    free(buf);
    if (!root) { snprintf(msg, msglen, "%s:%s (invalid JSON)", path, jerr); return 0; }
    memset(st->gpus, 0, sizeof st->gpus);
    st->ngpus = 0;
    st->nNotSupported = 0;
    int ok = load_tree(&c, st, root);
    json_free(root);
    if (!ok) { snprintf(msg, msglen, "%s", c.msg); st->ngpus = 0; return 0; }
    return 1;
}

/* ---------------------------------------------------------------------------------------------------------
 * Runtime control commands (see README "Runtime control"). Called with the state lock held.
 */
static int set_not_supported(char (*list)[64], unsigned *n, const char *fn, int on) {
    for (unsigned k = 0; k < *n; k++) {
        if (strcmp(list[k], fn) == 0) {
            if (!on) { memmove(list[k], list[k + 1], (size_t)(*n - k - 1) * 64); (*n)--; }
            return NVML_SUCCESS;
        }
    }
    if (!on) return NVML_SUCCESS;
    if (*n >= MOCK_MAX_NAMES) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(list[(*n)++], 64, "%s", fn);
    return NVML_SUCCESS;
}

int mock_command_locked(mock_state *st, const char *line) {
    char verb[32] = {0}, a[64] = {0}, b[64] = {0}, c[64] = {0}, d[64] = {0}, e[64] = {0};
    const char *hash = strchr(line, '#');
    char buf[512];
    snprintf(buf, sizeof buf, "%.*s", hash ? (int)(hash - line) : (int)strlen(line), line);
    int n = sscanf(buf, "%31s %63s %63s %63s %63s %63s", verb, a, b, c, d, e);
    if (n <= 0) return NVML_SUCCESS; /* blank or comment */
    if (strcmp(verb, "notsupported") == 0 && n == 4) {
        int on = atoi(c);
        if (strcmp(a, "*") == 0) return set_not_supported(st->notSupported, &st->nNotSupported, b, on);
        unsigned gi = (unsigned)strtoul(a, NULL, 10);
        if (gi >= st->ngpus) return NVML_ERROR_INVALID_ARGUMENT;
        return set_not_supported(st->gpus[gi].notSupported, &st->gpus[gi].nNotSupported, b, on);
    }
    if (strcmp(verb, "driver") == 0) { /* driver unloaded [<rc>] / driver loaded */
        if (n == 2 && strcmp(a, "loaded") == 0) {
            st->driverGone = 0;
            return NVML_SUCCESS;
        }
        if ((n == 2 || n == 3) && strcmp(a, "unloaded") == 0) {
            int rc = n == 3 ? (int)strtol(b, NULL, 0) : NVML_ERROR_DRIVER_NOT_LOADED;
            if (rc <= 0) return NVML_ERROR_INVALID_ARGUMENT;
            st->driverGone = rc;
            return NVML_SUCCESS;
        }
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    int mr = mock_mig_command_locked(st, verb, n, a, b, c, d, e);
    if (mr != -1) return mr;
    if (n < 2) return NVML_ERROR_INVALID_ARGUMENT;
    char *end = NULL;
    unsigned gpu = (unsigned)strtoul(a, &end, 10);
    if (!end || *end || gpu >= st->ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    mock_gpu *g = &st->gpus[gpu];
    if (strcmp(verb, "lost") == 0 && n == 3) return mock_set_lost_locked(st, gpu, atoi(b));
    if (strcmp(verb, "event") == 0 && (n == 4 || n == 6)) {
        unsigned long long type = strtoull(b, NULL, 0), data = strtoull(c, NULL, 0);
        unsigned gid = n == 6 ? (unsigned)strtoul(d, NULL, 0) : 0xFFFFFFFFu;
        unsigned cid = n == 6 ? (unsigned)strtoul(e, NULL, 0) : 0xFFFFFFFFu;
        return mock_inject_event_locked(st, gpu, type, data, gid, cid);
    }
    if (strcmp(verb, "ecc") == 0 && n == 5) {
        int unc = strcmp(b, "uncorrected") == 0, agg = strcmp(c, "aggregate") == 0;
        if ((!unc && strcmp(b, "corrected") != 0) || (!agg && strcmp(c, "volatile") != 0)) return NVML_ERROR_INVALID_ARGUMENT;
        long long v = strtoll(d, NULL, 0);
        *(unc ? (agg ? &g->v.eccAggUnc : &g->v.eccVolUnc) : (agg ? &g->v.eccAggCorr : &g->v.eccVolCorr)) = v;
        return NVML_SUCCESS;
    }
    if (strcmp(verb, "computemode") == 0 && n == 5)
        return mock_set_mig_compute_mode_locked(st, gpu, (unsigned)strtoul(b, NULL, 10), (unsigned)strtoul(c, NULL, 10),
                                                strtoll(d, NULL, 0));
    if (strcmp(verb, "set") == 0 && n == 4) {
        long long *p = mock_scalar(g, b);
        if (!p) return NVML_ERROR_NOT_FOUND;
        *p = strtoll(c, NULL, 0);
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* Apply complete lines appended to the control file since the last look. */
void mock_poll_control_locked(mock_state *st) {
    if (!st->controlPath[0]) return;
    struct stat sb;
    if (stat(st->controlPath, &sb) != 0) return;
    if ((long long)sb.st_size < st->controlOffset) st->controlOffset = 0; /* truncated: start over */
    if ((long long)sb.st_size == st->controlOffset) return;
    FILE *f = fopen(st->controlPath, "rb");
    if (!f) return;
    if (fseek(f, (long)st->controlOffset, SEEK_SET) == 0) {
        char line[512];
        while (fgets(line, sizeof line, f)) {
            size_t l = strlen(line);
            if (l == 0 || line[l - 1] != '\n') break; /* incomplete line: wait for the rest */
            st->controlOffset += (long long)l;
            line[l - 1] = '\0';
            int r = mock_command_locked(st, line);
            if (r != NVML_SUCCESS) fprintf(stderr, "mocknvml: control file %s: command '%s' failed (%d)\n", st->controlPath, line, r);
        }
    }
    fclose(f);
}
