/* The floor of the NVML poll benchmark: the same NVML calls the compiled poller makes, in a plain C loop.
 *
 * Built by bench/bench_nvmlpoll.py with the system compiler against the official nvml.h (nvidia-nvml-dev);
 * resolves NVML with dlopen("libnvidia-ml.so.1"), so it uses whichever library the process already loaded
 * (the mock on CI, the real driver on a GPU machine). Values go into caller-provided buffers.
 */
#include <dlfcn.h>
#include <string.h>
#include <nvml.h>

typedef nvmlReturn_t (*fv_fn)(nvmlDevice_t, int, nvmlFieldValue_t *);
typedef nvmlReturn_t (*util_fn)(nvmlDevice_t, nvmlUtilization_t *);
typedef nvmlReturn_t (*mem_fn)(nvmlDevice_t, nvmlMemory_v2_t *);
typedef nvmlReturn_t (*temp_fn)(nvmlDevice_t, nvmlTemperature_t *);
typedef nvmlReturn_t (*uint_fn)(nvmlDevice_t, unsigned int *);
typedef nvmlReturn_t (*clock_fn)(nvmlDevice_t, nvmlClockType_t, unsigned int *);
typedef nvmlReturn_t (*pcie_fn)(nvmlDevice_t, nvmlPcieUtilCounter_t, unsigned int *);
typedef nvmlReturn_t (*uuid_fn)(const char *, nvmlDevice_t *);

static fv_fn p_fv;
static util_fn p_util;
static mem_fn p_mem;
static temp_fn p_temp;
static uint_fn p_power;
static clock_fn p_clock;
static pcie_fn p_pcie;
static uuid_fn p_uuid;

#define MAX_DEV 1024
static nvmlDevice_t handles[MAX_DEV];
static int n_dev;

static const unsigned int FIELD_IDS[] = {3, 4, 5, 6, 29, 30, 31, 142, 143, 144, 145, 83};
#define N_FV (sizeof(FIELD_IDS) / sizeof(FIELD_IDS[0]))
#define N_VALUES (11 + N_FV)

int c_loop_values_per_device(void) { return (int)N_VALUES; }

/* Resolve the NVML symbols and the device handles; returns 0 or an nvmlReturn_t / -1 on dlopen failure. */
int c_loop_init(const char **uuids, int count) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return -1;
    p_fv = (fv_fn)dlsym(lib, "nvmlDeviceGetFieldValues");
    p_util = (util_fn)dlsym(lib, "nvmlDeviceGetUtilizationRates");
    p_mem = (mem_fn)dlsym(lib, "nvmlDeviceGetMemoryInfo_v2");
    p_temp = (temp_fn)dlsym(lib, "nvmlDeviceGetTemperatureV");
    p_power = (uint_fn)dlsym(lib, "nvmlDeviceGetPowerUsage");
    p_clock = (clock_fn)dlsym(lib, "nvmlDeviceGetClockInfo");
    p_pcie = (pcie_fn)dlsym(lib, "nvmlDeviceGetPcieThroughput");
    p_uuid = (uuid_fn)dlsym(lib, "nvmlDeviceGetHandleByUUID");
    if (!p_fv || !p_util || !p_mem || !p_temp || !p_power || !p_clock || !p_pcie || !p_uuid) return -2;
    if (count > MAX_DEV) return -3;
    for (int i = 0; i < count; i++) {
        nvmlReturn_t rc = p_uuid(uuids[i], &handles[i]);
        if (rc != NVML_SUCCESS) return (int)rc;
    }
    n_dev = count;
    return 0;
}

/* One poll of every device: values[n_dev * N_VALUES] doubles, status[n_dev * N_VALUES] ints. */
void c_loop_poll(double *values, int *status) {
    nvmlFieldValue_t fv[N_FV];
    for (int d = 0; d < n_dev; d++) {
        double *out = values + d * N_VALUES;
        int *st = status + d * N_VALUES;
        nvmlDevice_t h = handles[d];
        nvmlUtilization_t util;
        nvmlMemory_v2_t mem;
        nvmlTemperature_t temp;
        unsigned int u = 0;
        nvmlReturn_t rc = p_util(h, &util);
        st[0] = st[1] = rc;
        out[0] = rc == NVML_SUCCESS ? util.gpu : 0;
        out[1] = rc == NVML_SUCCESS ? util.memory : 0;
        mem.version = nvmlMemory_v2;
        rc = p_mem(h, &mem);
        st[2] = st[3] = st[4] = rc;
        out[2] = rc == NVML_SUCCESS ? (double)mem.total : 0;
        out[3] = rc == NVML_SUCCESS ? (double)mem.used : 0;
        out[4] = rc == NVML_SUCCESS ? (double)mem.free : 0;
        temp.version = nvmlTemperature_v1;
        temp.sensorType = NVML_TEMPERATURE_GPU;
        rc = p_temp(h, &temp);
        st[5] = rc;
        out[5] = rc == NVML_SUCCESS ? temp.temperature : 0;
        rc = p_power(h, &u);
        st[6] = rc;
        out[6] = rc == NVML_SUCCESS ? u : 0;
        rc = p_clock(h, NVML_CLOCK_SM, &u);
        st[7] = rc;
        out[7] = rc == NVML_SUCCESS ? u : 0;
        rc = p_clock(h, NVML_CLOCK_MEM, &u);
        st[8] = rc;
        out[8] = rc == NVML_SUCCESS ? u : 0;
        rc = p_pcie(h, NVML_PCIE_UTIL_TX_BYTES, &u);
        st[9] = rc;
        out[9] = rc == NVML_SUCCESS ? u : 0;
        rc = p_pcie(h, NVML_PCIE_UTIL_RX_BYTES, &u);
        st[10] = rc;
        out[10] = rc == NVML_SUCCESS ? u : 0;
        memset(fv, 0, sizeof(fv));
        for (unsigned k = 0; k < N_FV; k++) fv[k].fieldId = FIELD_IDS[k];
        rc = p_fv(h, (int)N_FV, fv);
        for (unsigned k = 0; k < N_FV; k++) {
            st[11 + k] = rc != NVML_SUCCESS ? rc : fv[k].nvmlReturn;
            out[11 + k] = (rc == NVML_SUCCESS && fv[k].nvmlReturn == NVML_SUCCESS) ? (double)fv[k].value.ullVal : 0;
        }
    }
}
