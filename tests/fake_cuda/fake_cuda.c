/* A stand-in for the CUDA driver's host-function entry point, for tests on machines without
 * a GPU. A "stream" runs its operations (host functions, memory copies, gates) one after the
 * other on its own thread, as a CUDA stream does; capture records them into a "graph" that
 * can be replayed with the same arguments. Build: cc -shared -fPIC -O2 -pthread. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*host_fn)(void *);

enum kind { OP_HOST, OP_COPY, OP_GATE, OP_MARK };

struct op {
    enum kind kind;
    host_fn fn;
    void *arg;
    void *dst;
    const void *src;
    size_t n;
    struct op *next;
};

struct graph {
    int count, cap;
    struct op *ops;
};

struct stream {
    pthread_mutex_t m;
    pthread_cond_t cv, gate_cv;
    struct op *head, *tail;
    int busy, gate_open, stop;
    long done_ops, host_calls, marks;
    struct graph *capture;
    void *ctx; /* the "context" the stream belongs to (fake_stream_set_ctx) */
    pthread_t thread;
};

/* Contexts are opaque pointers: 0x1000 + device. Each thread starts with device 0's current,
 * as a thread that has used torch on device 0 has. */
#define DEVICE0_CTX ((void *)0x1000)
static __thread void *current_ctx = DEVICE0_CTX;
static __thread void *ctx_stack[8];
static __thread int ctx_depth;
static long ctx_pushes;

static void *run(void *p) {
    struct stream *s = p;
    pthread_mutex_lock(&s->m);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->m);
        if (!s->head) break;
        struct op *o = s->head;
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->busy = 1;
        if (o->kind == OP_GATE) {
            while (!s->gate_open) pthread_cond_wait(&s->gate_cv, &s->m);
            s->gate_open = 0;
        }
        pthread_mutex_unlock(&s->m);
        if (o->kind == OP_HOST) o->fn(o->arg);
        if (o->kind == OP_COPY) memcpy(o->dst, o->src, o->n);
        pthread_mutex_lock(&s->m);
        if (o->kind == OP_HOST) s->host_calls++;
        if (o->kind == OP_MARK) s->marks++;
        s->done_ops++;
        s->busy = 0;
        free(o);
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->m);
    return NULL;
}

void *fake_stream_create(void) {
    struct stream *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->m, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->gate_cv, NULL);
    s->ctx = current_ctx;
    pthread_create(&s->thread, NULL, run, s);
    return s;
}

static void push(struct stream *s, struct op o) {
    pthread_mutex_lock(&s->m);
    if (s->capture) {
        struct graph *g = s->capture;
        if (g->count == g->cap) {
            g->cap = g->cap ? 2 * g->cap : 16;
            g->ops = realloc(g->ops, g->cap * sizeof *g->ops);
        }
        g->ops[g->count++] = o;
    } else {
        struct op *p = malloc(sizeof *p);
        *p = o;
        p->next = NULL;
        if (s->tail) s->tail->next = p; else s->head = p;
        s->tail = p;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->m);
}

/* Handle 0 is the legacy default stream, made at first use. */
static pthread_once_t default_once = PTHREAD_ONCE_INIT;
static void *default_stream;
static void make_default(void) { default_stream = fake_stream_create(); }
static void *resolve(void *stream) {
    if (stream) return stream;
    pthread_once(&default_once, make_default);
    return default_stream;
}

/* A stream of another context than the calling thread's (the legacy one is always its). */
static int wrong_ctx(void *stream) {
    return stream && ((struct stream *)stream)->ctx != current_ctx;
}

/* The entry point kt-kernel opens: CUresult cuLaunchHostFunc(CUstream, CUhostFn, void*). */
int cuLaunchHostFunc(void *stream, host_fn fn, void *arg) {
    if (!fn) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    if (wrong_ctx(stream)) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    stream = resolve(stream);
    push(stream, (struct op){.kind = OP_HOST, .fn = fn, .arg = arg});
    return 0;
}

void fake_memcpy_async(void *stream, void *dst, const void *src, size_t n) {
    push(stream, (struct op){.kind = OP_COPY, .dst = dst, .src = src, .n = n});
}

/* CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t, CUstream): "device"
 * memory is host memory. Like the real one, it needs the stream's context current. */
int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, void *stream) {
    if (wrong_ctx(stream)) return 201;
    stream = resolve(stream);
    fake_memcpy_async(stream, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return 0;
}

int cuStreamGetCtx(void *stream, void **ctx) {
    if (!stream) { /* the legacy stream belongs to the calling thread's context */
        *ctx = current_ctx;
        return 0;
    }
    *ctx = ((struct stream *)stream)->ctx;
    return 0;
}

int cuCtxGetCurrent(void **ctx) {
    *ctx = current_ctx;
    return 0;
}

int cuCtxPushCurrent_v2(void *ctx) {
    if (ctx_depth == 8) return 1;
    ctx_stack[ctx_depth++] = current_ctx;
    current_ctx = ctx;
    __atomic_add_fetch(&ctx_pushes, 1, __ATOMIC_SEQ_CST);
    return 0;
}

int cuCtxPopCurrent_v2(void **ctx) {
    if (!ctx_depth) return 201;
    if (ctx) *ctx = current_ctx;
    current_ctx = ctx_stack[--ctx_depth];
    return 0;
}

/* Make `stream` belong to device `device`'s context (another GPU of the process). */
void fake_stream_set_device(void *stream, int device) {
    ((struct stream *)stream)->ctx = (void *)(uintptr_t)(0x1000 + device);
}

long fake_ctx_pushes(void) { return __atomic_load_n(&ctx_pushes, __ATOMIC_SEQ_CST); }

/* The stream stops at this point until fake_gate_open. */
void fake_gate(void *stream) { push(stream, (struct op){.kind = OP_GATE}); }

void fake_gate_open(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    s->gate_open = 1;
    pthread_cond_broadcast(&s->gate_cv);
    pthread_mutex_unlock(&s->m);
}

/* A marker: fake_marks counts those the stream has passed (an event). */
void fake_mark(void *stream) { push(stream, (struct op){.kind = OP_MARK}); }

long fake_marks(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    long n = s->marks;
    pthread_mutex_unlock(&s->m);
    return n;
}

void fake_stream_synchronize(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->m);
    pthread_mutex_unlock(&s->m);
}

long fake_host_calls(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    long n = s->host_calls;
    pthread_mutex_unlock(&s->m);
    return n;
}

void fake_capture_begin(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    s->capture = calloc(1, sizeof(struct graph));
    pthread_mutex_unlock(&s->m);
}

void *fake_capture_end(void *stream) {
    struct stream *s = stream;
    pthread_mutex_lock(&s->m);
    struct graph *g = s->capture;
    s->capture = NULL;
    pthread_mutex_unlock(&s->m);
    return g;
}

void fake_graph_launch(void *graph, void *stream) {
    struct graph *g = graph;
    for (int i = 0; i < g->count; i++) push(stream, g->ops[i]);
}

/* The host-function arguments a graph holds, in order; returns how many. */
int fake_graph_host_args(void *graph, uintptr_t *out, int max) {
    struct graph *g = graph;
    int n = 0;
    for (int i = 0; i < g->count; i++)
        if (g->ops[i].kind == OP_HOST) {
            if (n < max) out[n] = (uintptr_t)g->ops[i].arg;
            n++;
        }
    return n;
}

/* The driver entry points of the layerwise transport's copy thread. "Device" memory is host
 * memory; the context calls only record that they happened (fake_bound_device). */
static int bound_device = -1;
static long htod_copies;

int cuInit(unsigned flags) { return flags == 0 ? 0 : 1; /* CUDA_ERROR_INVALID_VALUE */ }

int cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal > 7) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *dev = ordinal;
    return 0;
}

int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    *ctx = (void *)(uintptr_t)(0x1000 + dev);
    return 0;
}

int cuCtxSetCurrent(void *ctx) {
    current_ctx = ctx;
    __atomic_store_n(&bound_device, (int)((uintptr_t)ctx - 0x1000), __ATOMIC_SEQ_CST);
    return 0;
}

int cuStreamCreate(void **stream, unsigned flags) {
    (void)flags;
    *stream = fake_stream_create();
    return 0;
}

int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t n, void *stream) {
    if (!stream) return 400;
    __atomic_add_fetch(&htod_copies, 1, __ATOMIC_SEQ_CST);
    fake_memcpy_async(stream, (void *)(uintptr_t)dst, src, n);
    return 0;
}

int cuStreamSynchronize(void *stream) {
    fake_stream_synchronize(stream);
    return 0;
}

int fake_bound_device(void) { return __atomic_load_n(&bound_device, __ATOMIC_SEQ_CST); }
long fake_htod_copies(void) { return __atomic_load_n(&htod_copies, __ATOMIC_SEQ_CST); }
