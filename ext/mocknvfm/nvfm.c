/* Mock libnvfm.so.1: NVIDIA's Fabric Manager SDK entry points (nvfm.h), each forwarded as one line of text over the
 * connection fmConnect opened to a Fabric Manager stand-in (dradriver/sandbox/standins/nv_fabricmanager.py). The
 * library keeps no partition state: the daemon owns the table, the activation state and the faults. Protocol: see
 * README.md. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "nvfm.h"

#define HANDLE_MAGIC 0x6e76666du /* "nvfm" */
#define FM_CMD_PORT_NUMBER 6666  /* nv_fm_types.h: the default TCP port */

typedef struct conn {
    unsigned magic;
    int fd;
    char buf[8192];
    size_t len;
    struct conn *next;
} conn;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static conn *g_conns;

/* ---- connections ------------------------------------------------------------------------------------------- */

static int open_unix(const char *path) {
    struct sockaddr_un sa;
    if (strlen(path) >= sizeof sa.sun_path) return -2; /* no such socket address: BADPARAM */
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) { close(fd); return -1; }
    return fd;
}

/* "a.b.c.d" or "a.b.c.d:port" (nv_fm_agent.h fmConnect); -2 when the text is not such an address, -1 when
 * nothing answers there. */
static int open_tcp(const char *address) {
    char host[FM_MAX_STR_LENGTH];
    snprintf(host, sizeof host, "%s", address);
    unsigned port = FM_CMD_PORT_NUMBER;
    char *colon = strchr(host, ':');
    if (colon) {
        char *end;
        unsigned long p = strtoul(colon + 1, &end, 10);
        if (*end || p == 0 || p > 65535) return -2;
        port = (unsigned)p;
        *colon = 0;
    }
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((unsigned short)port);
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) return -2;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) { close(fd); return -1; }
    return fd;
}

static conn *find_conn_locked(fmHandle_t h) {
    for (conn *c = g_conns; c; c = c->next)
        if ((void *)c == h && c->magic == HANDLE_MAGIC) return c;
    return NULL;
}

static void drop_conn_locked(conn *c) {
    for (conn **p = &g_conns; *p; p = &(*p)->next)
        if (*p == c) { *p = c->next; break; }
    close(c->fd);
    c->magic = 0;
    free(c);
}

/* Send one request line; FM_ST_CONNECTION_NOT_VALID when the daemon is gone. */
static fmReturn_t send_line(conn *c, const char *line) {
    size_t n = strlen(line), off = 0;
    while (off < n) {
        ssize_t k = send(c->fd, line + off, n - off, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? FM_ST_TIMEOUT : FM_ST_CONNECTION_NOT_VALID;
        off += (size_t)k;
    }
    return FM_ST_SUCCESS;
}

/* Read one answer line (without '\n') into out; FM_ST_TIMEOUT past the connection's timeout, CONNECTION_NOT_VALID
 * when the daemon closed the connection. */
static fmReturn_t read_line(conn *c, char *out, size_t outlen) {
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->len);
        if (nl) {
            size_t n = (size_t)(nl - c->buf);
            if (n >= outlen) return FM_ST_GENERIC_ERROR;
            memcpy(out, c->buf, n);
            out[n] = 0;
            memmove(c->buf, nl + 1, c->len - n - 1);
            c->len -= n + 1;
            return FM_ST_SUCCESS;
        }
        if (c->len == sizeof c->buf) return FM_ST_GENERIC_ERROR;
        ssize_t k = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? FM_ST_TIMEOUT : FM_ST_CONNECTION_NOT_VALID;
        if (k == 0) return FM_ST_CONNECTION_NOT_VALID;
        c->len += (size_t)k;
    }
}

/* One request answered by one line holding an fmReturn_t. */
static fmReturn_t call_simple(conn *c, const char *line) {
    fmReturn_t rc = send_line(c, line);
    if (rc != FM_ST_SUCCESS) return rc;
    char answer[64];
    rc = read_line(c, answer, sizeof answer);
    if (rc != FM_ST_SUCCESS) return rc;
    int value;
    if (sscanf(answer, "%d", &value) != 1) return FM_ST_GENERIC_ERROR;
    return (fmReturn_t)value;
}

/* ---- the SDK ----------------------------------------------------------------------------------------------- */

fmReturn_t fmLibInit(void) {
    pthread_mutex_lock(&g_lock);
    fmReturn_t rc = g_initialized ? FM_ST_IN_USE : FM_ST_SUCCESS;
    g_initialized = 1;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

fmReturn_t fmLibShutdown(void) {
    pthread_mutex_lock(&g_lock);
    if (!g_initialized) { pthread_mutex_unlock(&g_lock); return FM_ST_UNINITIALIZED; }
    while (g_conns) drop_conn_locked(g_conns); /* "any remote connections ... shut down as well" */
    g_initialized = 0;
    pthread_mutex_unlock(&g_lock);
    return FM_ST_SUCCESS;
}

fmReturn_t fmConnect(fmConnectParams_t *params, fmHandle_t *pFmHandle) {
    pthread_mutex_lock(&g_lock);
    fmReturn_t rc = FM_ST_SUCCESS;
    if (!g_initialized) rc = FM_ST_UNINITIALIZED;
    else if (!params || !pFmHandle) rc = FM_ST_BADPARAM;
    else if (params->version != fmConnectParams_version) rc = FM_ST_VERSION_MISMATCH;
    else if (!memchr(params->addressInfo, 0, sizeof params->addressInfo) || !params->addressInfo[0]) rc = FM_ST_BADPARAM;
    if (rc != FM_ST_SUCCESS) { pthread_mutex_unlock(&g_lock); return rc; }
    int fd = params->addressIsUnixSocket ? open_unix(params->addressInfo) : open_tcp(params->addressInfo);
    if (fd == -2) { pthread_mutex_unlock(&g_lock); return FM_ST_BADPARAM; }
    if (fd < 0) { pthread_mutex_unlock(&g_lock); return FM_ST_CONNECTION_NOT_VALID; }
    if (params->timeoutMs) {
        struct timeval tv = {.tv_sec = params->timeoutMs / 1000, .tv_usec = (params->timeoutMs % 1000) * 1000};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    conn *c = calloc(1, sizeof *c);
    if (!c) { close(fd); pthread_mutex_unlock(&g_lock); return FM_ST_GENERIC_ERROR; }
    c->magic = HANDLE_MAGIC;
    c->fd = fd;
    rc = call_simple(c, "HELLO 1\n"); /* the daemon may refuse (a fault) or be gone */
    if (rc != FM_ST_SUCCESS) {
        close(fd);
        free(c);
        pthread_mutex_unlock(&g_lock);
        return rc;
    }
    c->next = g_conns;
    g_conns = c;
    *pFmHandle = (fmHandle_t)c;
    pthread_mutex_unlock(&g_lock);
    return FM_ST_SUCCESS;
}

fmReturn_t fmDisconnect(fmHandle_t h) {
    pthread_mutex_lock(&g_lock);
    fmReturn_t rc = FM_ST_SUCCESS;
    conn *c = g_initialized ? find_conn_locked(h) : NULL;
    if (!g_initialized) rc = FM_ST_UNINITIALIZED;
    else if (!c) rc = FM_ST_BADPARAM;
    else drop_conn_locked(c);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Entry checks shared by the partition calls: initialised, a live handle. */
#define ENTER(h, c)                                                                   \
    pthread_mutex_lock(&g_lock);                                                      \
    if (!g_initialized) { pthread_mutex_unlock(&g_lock); return FM_ST_UNINITIALIZED; } \
    conn *c = find_conn_locked(h);                                                    \
    if (!c) { pthread_mutex_unlock(&g_lock); return FM_ST_BADPARAM; }
#define LEAVE(x) do { fmReturn_t r_ = (x); pthread_mutex_unlock(&g_lock); return r_; } while (0)

static fmReturn_t read_list(conn *c, fmFabricPartitionList_t *out) {
    char line[512];
    fmReturn_t rc = read_line(c, line, sizeof line);
    if (rc != FM_ST_SUCCESS) return rc;
    int status;
    unsigned n = 0, max = 0;
    int got = sscanf(line, "%d %u %u", &status, &n, &max);
    if (got < 1) return FM_ST_GENERIC_ERROR;
    if (status != FM_ST_SUCCESS) return (fmReturn_t)status;
    if (got != 3 || n > FM_MAX_FABRIC_PARTITIONS) return FM_ST_GENERIC_ERROR;
    unsigned version = out->version;
    memset(out, 0, sizeof *out);
    out->version = version;
    out->numPartitions = n;
    out->maxNumPartitions = max;
    for (unsigned i = 0; i < n; i++) {
        fmFabricPartitionInfo_t *p = &out->partitionInfo[i];
        if ((rc = read_line(c, line, sizeof line)) != FM_ST_SUCCESS) return rc;
        if (sscanf(line, "P %u %u %u", &p->partitionId, &p->isActive, &p->numGpus) != 3 ||
            p->numGpus > FM_MAX_NUM_GPUS)
            return FM_ST_GENERIC_ERROR;
        for (unsigned j = 0; j < p->numGpus; j++) {
            fmFabricPartitionGpuInfo_t *g = &p->gpuInfo[j];
            if ((rc = read_line(c, line, sizeof line)) != FM_ST_SUCCESS) return rc;
            if (sscanf(line, "G %u %79s %31s %u %u %u", &g->physicalId, g->uuid, g->pciBusId, &g->numNvLinksAvailable,
                       &g->maxNumNvLinks, &g->nvlinkLineRateMBps) != 6)
                return FM_ST_GENERIC_ERROR;
            if (strcmp(g->uuid, "-") == 0) g->uuid[0] = 0; /* "-": the daemon has no value */
            if (strcmp(g->pciBusId, "-") == 0) g->pciBusId[0] = 0;
        }
    }
    return FM_ST_SUCCESS;
}

fmReturn_t fmGetSupportedFabricPartitions(fmHandle_t h, fmFabricPartitionList_t *list) {
    ENTER(h, c);
    if (!list) LEAVE(FM_ST_BADPARAM);
    if (list->version != fmFabricPartitionList_version) LEAVE(FM_ST_VERSION_MISMATCH);
    fmReturn_t rc = send_line(c, "LIST\n");
    LEAVE(rc != FM_ST_SUCCESS ? rc : read_list(c, list));
}

fmReturn_t fmActivateFabricPartition(fmHandle_t h, fmFabricPartitionId_t id) {
    ENTER(h, c);
    char line[64];
    snprintf(line, sizeof line, "ACTIVATE %u\n", id);
    LEAVE(call_simple(c, line));
}

fmReturn_t fmDeactivateFabricPartition(fmHandle_t h, fmFabricPartitionId_t id) {
    ENTER(h, c);
    char line[64];
    snprintf(line, sizeof line, "DEACTIVATE %u\n", id);
    LEAVE(call_simple(c, line));
}

fmReturn_t fmSetActivatedFabricPartitions(fmHandle_t h, fmActivatedFabricPartitionList_t *list) {
    ENTER(h, c);
    if (!list) LEAVE(FM_ST_BADPARAM);
    if (list->version != fmActivatedFabricPartitionList_version) LEAVE(FM_ST_VERSION_MISMATCH);
    if (list->numPartitions > FM_MAX_FABRIC_PARTITIONS) LEAVE(FM_ST_BADPARAM);
    char line[FM_MAX_FABRIC_PARTITIONS * 12 + 32];
    int k = snprintf(line, sizeof line, "SETACTIVE %u", list->numPartitions);
    for (unsigned i = 0; i < list->numPartitions; i++)
        k += snprintf(line + k, sizeof line - (size_t)k, " %u", list->partitionIds[i]);
    snprintf(line + k, sizeof line - (size_t)k, "\n");
    LEAVE(call_simple(c, line));
}
