/* How fast can a CUDA stream hand work to a CPU thread and get it back? The stream path of
 * submit_forward/sync_forward uses two host functions per layer (cuLaunchHostFunc: start,
 * then a sync that holds the stream). This probe times a miniature layer (small copies in and
 * out, a fixed stretch of CPU work on a worker thread) with each way of signalling:
 *
 *   blocking   copy to the host, work on the calling thread, copy back (no stream ordering)
 *   hostfunc   host function starts the work, a second host function holds the stream
 *   waitvalue  host function starts the work, cuStreamWaitValue32 on a host-mapped flag holds
 *              the stream (the worker sets the flag), cuStreamWriteValue32 re-arms it
 *   doorbell   cuStreamWriteValue32 rings a host-mapped doorbell that the (spinning) worker
 *              polls, cuStreamWaitValue32 holds the stream as above: no host function at all
 *
 * each issued directly and replayed from a captured CUDA graph. Needs a CUDA GPU; the driver
 * is opened with dlopen, so it builds without CUDA headers:
 *   cc -O2 -pthread -o cuda_signal_probe benches/cuda_signal_probe.c -ldl
 *   ./cuda_signal_probe [work_us=200] [steps=200] [layers=8]
 * Prints, per mode, the median time per layer and what it adds to the work itself. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUcontext;
typedef void *CUgraph;
typedef void *CUgraphExec;
typedef uint64_t CUdeviceptr;
typedef void (*host_fn)(void *);

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);
static CUresult (*cuStreamSynchronize)(CUstream);
static CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
static CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*cuLaunchHostFunc)(CUstream, host_fn, void *);
static CUresult (*cuStreamWriteValue32)(CUstream, CUdeviceptr, uint32_t, unsigned);
static CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, uint32_t, unsigned);
static CUresult (*cuStreamBeginCapture)(CUstream, int);
static CUresult (*cuStreamEndCapture)(CUstream, CUgraph *);
static CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph, unsigned long long);
static CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
static CUresult (*cuDeviceGetAttribute)(int *, int, int);

#define WAIT_EQ 1
#define MAX_LAYERS 64
#define BYTES 4096

static void *lib;
static void *sym(const char *a, const char *b) {
    void *p = dlsym(lib, a);
    if (!p && b) p = dlsym(lib, b);
    if (!p) {
        fprintf(stderr, "missing %s\n", a);
        exit(2);
    }
    return p;
}

#define CK(call)                                                                     \
    do {                                                                             \
        CUresult r_ = (call);                                                        \
        if (r_) {                                                                    \
            fprintf(stderr, "%s:%d %s -> CUresult %d\n", __FILE__, __LINE__, #call, r_); \
            return r_;                                                               \
        }                                                                            \
    } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static double work_us = 200;
static void busy(void) {
    double end = now_us() + work_us;
    while (now_us() < end) {
    }
}

/* Host-mapped flags: doorbell[l] (GPU writes 1, worker clears), done[l] (worker writes 1,
 * GPU waits for 1 then writes 0). */
static volatile uint32_t *doorbell, *done;
static CUdeviceptr doorbell_d, done_d;
/* Requests from host functions: a counter the worker follows. */
static volatile uint64_t requested, finished;
static volatile int poll_doorbells, stop;
static int layers = 8;

static void *worker(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    int next = 0;
    while (!stop) {
        if (poll_doorbells) {
            if (__atomic_load_n(&doorbell[next], __ATOMIC_ACQUIRE) != 1) continue;
            doorbell[next] = 0;
            busy();
            __atomic_store_n(&done[next], 1, __ATOMIC_RELEASE);
            next = (next + 1) % layers;
            continue;
        }
        uint64_t r = __atomic_load_n(&requested, __ATOMIC_ACQUIRE);
        if (r == seen) continue;
        int l = (int)(seen % layers);
        seen++;
        busy();
        __atomic_store_n(&done[l], 1, __ATOMIC_RELEASE);
        __atomic_store_n(&finished, seen, __ATOMIC_RELEASE);
    }
    return NULL;
}

static void start_fn(void *arg) {
    (void)arg;
    __atomic_add_fetch(&requested, 1, __ATOMIC_ACQ_REL);
}

static void sync_fn(void *arg) {
    (void)arg;
    while (__atomic_load_n(&finished, __ATOMIC_ACQUIRE) != __atomic_load_n(&requested, __ATOMIC_ACQUIRE)) {
    }
}

static CUstream stream;
static CUdeviceptr dev_in, dev_out;
static char *pin_in, *pin_out;

enum mode { HOSTFUNC, WAITVALUE, DOORBELL };
static const char *names[] = {"hostfunc", "waitvalue", "doorbell"};

static CUresult enqueue_layer(enum mode m, int l) {
    CK(cuMemcpyAsync((CUdeviceptr)(uintptr_t)pin_in, dev_in, BYTES, stream));
    if (m == DOORBELL)
        CK(cuStreamWriteValue32(stream, doorbell_d + 4 * l, 1, 0));
    else
        CK(cuLaunchHostFunc(stream, start_fn, NULL));
    if (m == HOSTFUNC) {
        CK(cuLaunchHostFunc(stream, sync_fn, NULL));
    } else {
        CK(cuStreamWaitValue32(stream, done_d + 4 * l, 1, WAIT_EQ));
        CK(cuStreamWriteValue32(stream, done_d + 4 * l, 0, 0));
    }
    CK(cuMemcpyAsync(dev_out, (CUdeviceptr)(uintptr_t)pin_out, BYTES, stream));
    return 0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp);
    return v[n / 2];
}

/* Median per-layer time of `steps` steps of `layers` layers, issued directly or from a graph. */
static CUresult run_mode(enum mode m, int graph, int steps, double *out) {
    double *t = calloc(steps, sizeof *t);
    CUgraphExec exec = NULL;
    /* Between runs the stream is idle and the worker waits: clear what a mode left set. The
     * request counters only grow (the worker follows them). */
    memset((void *)done, 0, 4 * MAX_LAYERS);
    memset((void *)doorbell, 0, 4 * MAX_LAYERS);
    poll_doorbells = m == DOORBELL;
    if (graph) {
        CUgraph g;
        CK(cuStreamBeginCapture(stream, 2 /* relaxed */));
        for (int l = 0; l < layers; l++) CK(enqueue_layer(m, l));
        CK(cuStreamEndCapture(stream, &g));
        CK(cuGraphInstantiateWithFlags(&exec, g, 0));
    }
    for (int s = -5; s < steps; s++) {
        double t0 = now_us();
        if (graph)
            CK(cuGraphLaunch(exec, stream));
        else
            for (int l = 0; l < layers; l++) CK(enqueue_layer(m, l));
        CK(cuStreamSynchronize(stream));
        if (s >= 0) t[s] = (now_us() - t0) / layers;
    }
    *out = median(t, steps);
    free(t);
    return 0;
}

static int blocking(int steps, double *out) {
    CUresult (*dtoh)(void *, CUdeviceptr, size_t) = sym("cuMemcpyDtoH_v2", "cuMemcpyDtoH");
    CUresult (*htod)(CUdeviceptr, const void *, size_t) = sym("cuMemcpyHtoD_v2", "cuMemcpyHtoD");
    double *t = calloc(steps, sizeof *t);
    for (int s = -5; s < steps; s++) {
        double t0 = now_us();
        for (int l = 0; l < layers; l++) {
            CK(dtoh(pin_in, dev_in, BYTES));
            busy();
            CK(htod(dev_out, pin_out, BYTES));
        }
        if (s >= 0) t[s] = (now_us() - t0) / layers;
    }
    *out = median(t, steps);
    free(t);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1) work_us = atof(argv[1]);
    int steps = argc > 2 ? atoi(argv[2]) : 200;
    if (argc > 3) layers = atoi(argv[3]);
    if (layers < 1 || layers > MAX_LAYERS) return 2;
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "no libcuda.so.1\n");
        return 2;
    }
    cuInit = sym("cuInit", NULL);
    cuDeviceGet = sym("cuDeviceGet", NULL);
    cuDevicePrimaryCtxRetain = sym("cuDevicePrimaryCtxRetain", NULL);
    cuCtxSetCurrent = sym("cuCtxSetCurrent", NULL);
    cuStreamCreate = sym("cuStreamCreate", NULL);
    cuStreamSynchronize = sym("cuStreamSynchronize", NULL);
    cuMemHostAlloc = sym("cuMemHostAlloc", NULL);
    cuMemHostGetDevicePointer = sym("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer");
    cuMemAlloc = sym("cuMemAlloc_v2", "cuMemAlloc");
    cuMemcpyAsync = sym("cuMemcpyAsync", NULL);
    cuLaunchHostFunc = sym("cuLaunchHostFunc", NULL);
    cuStreamWriteValue32 = sym("cuStreamWriteValue32_v2", "cuStreamWriteValue32");
    cuStreamWaitValue32 = sym("cuStreamWaitValue32_v2", "cuStreamWaitValue32");
    cuStreamBeginCapture = sym("cuStreamBeginCapture_v2", "cuStreamBeginCapture");
    cuStreamEndCapture = sym("cuStreamEndCapture", NULL);
    cuGraphInstantiateWithFlags = sym("cuGraphInstantiateWithFlags", NULL);
    cuGraphLaunch = sym("cuGraphLaunch", NULL);
    cuDeviceGetAttribute = sym("cuDeviceGetAttribute", NULL);

    int dev;
    CUcontext ctx;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    /* 92 CAN_USE_STREAM_MEM_OPS_V1, 94 CAN_USE_STREAM_WAIT_VALUE_NOR_V1, 91
     * CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM (values from cuda.h). */
    int attrs[] = {91, 92, 94};
    for (int i = 0; i < 3; i++) {
        int v = -1;
        CUresult r = cuDeviceGetAttribute(&v, attrs[i], dev);
        printf("device attribute %d = %d (CUresult %d)\n", attrs[i], v, r);
    }
    CK(cuStreamCreate(&stream, 1 /* non-blocking */));
    void *flags;
    CK(cuMemHostAlloc(&flags, 2 * 4 * MAX_LAYERS, 0x01 | 0x02 /* portable | devicemap */));
    memset(flags, 0, 2 * 4 * MAX_LAYERS);
    doorbell = flags;
    done = (uint32_t *)flags + MAX_LAYERS;
    CK(cuMemHostGetDevicePointer(&doorbell_d, (void *)doorbell, 0));
    CK(cuMemHostGetDevicePointer(&done_d, (void *)done, 0));
    CK(cuMemHostAlloc((void **)&pin_in, BYTES, 0x01));
    CK(cuMemHostAlloc((void **)&pin_out, BYTES, 0x01));
    CK(cuMemAlloc(&dev_in, BYTES));
    CK(cuMemAlloc(&dev_out, BYTES));

    pthread_t w;
    pthread_create(&w, NULL, worker, NULL);
    printf("work %.0f us per layer, %d layers per step, %d steps; median per layer\n", work_us,
           layers, steps);
    double b;
    if (blocking(steps, &b) == 0)
        printf("%-10s %-6s %8.1f us  (+%.1f)\n", "blocking", "direct", b, b - work_us);
    for (int round = 0; round < 2; round++)
        for (int m = HOSTFUNC; m <= DOORBELL; m++)
            for (int graph = 0; graph < 2; graph++) {
                double v;
                CUresult r = run_mode(m, graph, steps, &v);
                if (r)
                    printf("%-10s %-6s failed (CUresult %d)\n", names[m], graph ? "graph" : "direct", r);
                else
                    printf("%-10s %-6s %8.1f us  (+%.1f)\n", names[m], graph ? "graph" : "direct", v,
                           v - work_us);
                fflush(stdout);
            }
    stop = 1;
    pthread_join(w, NULL);
    return 0;
}
