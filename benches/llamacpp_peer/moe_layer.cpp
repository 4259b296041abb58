// Peer benchmark: one MoE layer (gate and up, SwiGLU, down) through ggml's CPU `mul_mat_id`, the
// op llama.cpp runs for MoE experts. Written for kt-kernel's benches against ggml's public API.
//
//   moe_layer <q4_K|q8_0> <repack 0|1> <threads> <min_seconds> <tokens>...
//
// Weights: 3 layers (cycled, so decode streams them from DRAM) of E=128 experts, H=2048, I=768
// (Qwen3-30B-A3B), quantized by ggml from random normals; with repack=1 (q4_K only) they live in
// the CPU_REPACK buffer type, as llama.cpp places Q4_K experts on AVX2 CPUs. Each timed call gets fresh
// random top-8 routing. Prints one JSON object per token count.
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
constexpr int kHidden = 2048, kInter = 768, kExperts = 128, kTopK = 8, kLayers = 3;

struct Layer {
    ggml_tensor *gate, *up, *down;
};

ggml_backend_buffer_type_t repack_buffer_type(ggml_backend_t backend) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t *b = get_extra ? get_extra(dev) : nullptr; b && *b; ++b) {
        if (std::string(ggml_backend_buft_name(*b)) == "CPU_REPACK") return *b;
    }
    return nullptr;
}

// One expert quantized from normals, copied to every expert: speed does not depend on values.
void fill_experts(ggml_tensor *t, std::mt19937 &rng) {
    const int64_t k = t->ne[0], n = t->ne[1];
    std::normal_distribution<float> normal(0.f, 0.02f);
    std::vector<float> src(k * n);
    for (auto &v : src) v = normal(rng);
    const size_t expert_bytes = ggml_row_size(t->type, k) * n;
    std::vector<uint8_t> packed(expert_bytes * kExperts);
    ggml_quantize_chunk(t->type, src.data(), packed.data(), 0, n, k, nullptr);
    for (int e = 1; e < kExperts; ++e)
        memcpy(packed.data() + e * expert_bytes, packed.data(), expert_bytes);
    ggml_backend_tensor_set(t, packed.data(), 0, packed.size());
}
}  // namespace

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s <q4_K|q8_0> <repack 0|1> <threads> <min_seconds> <tokens>...\n", argv[0]);
        return 2;
    }
    const std::string type_name = argv[1];
    const ggml_type wtype = type_name == "q8_0" ? GGML_TYPE_Q8_0 : GGML_TYPE_Q4_K;
    if (type_name != "q8_0" && type_name != "q4_K") {
        fprintf(stderr, "unknown type %s\n", argv[1]);
        return 2;
    }
    const bool repack = atoi(argv[2]) != 0;
    if (repack && wtype != GGML_TYPE_Q4_K) {
        // ggml's x86 repacking covers Q4_K (q4_K_8x8); its Q8_0 layouts need ARM or RISC-V, and a
        // Q8_0 tensor in the CPU_REPACK buffer crashes. llama.cpp keeps such tensors in plain memory.
        fprintf(stderr, "repack=1 is for q4_K only on x86\n");
        return 2;
    }
    const int threads = atoi(argv[3]);
    const double min_seconds = atof(argv[4]);

    ggml_backend_t backend = ggml_backend_cpu_init();
    // A persistent pool, as llama.cpp's context keeps one (otherwise every call spawns threads).
    ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
    ggml_threadpool_t pool = ggml_threadpool_new(&pool_params);
    ggml_backend_cpu_set_threadpool(backend, pool);
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_buffer_type_t wbuft = ggml_backend_get_default_buffer_type(backend);
    if (repack) {
        wbuft = repack_buffer_type(backend);
        if (!wbuft) {
            fprintf(stderr, "this ggml build has no CPU_REPACK buffer type\n");
            return 1;
        }
    }

    ggml_init_params wparams = {3 * kLayers * ggml_tensor_overhead() + 1024, nullptr, true};
    ggml_context *wctx = ggml_init(wparams);
    std::vector<Layer> layers(kLayers);
    for (auto &l : layers) {
        l.gate = ggml_new_tensor_3d(wctx, wtype, kHidden, kInter, kExperts);
        l.up = ggml_new_tensor_3d(wctx, wtype, kHidden, kInter, kExperts);
        l.down = ggml_new_tensor_3d(wctx, wtype, kInter, kHidden, kExperts);
    }
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, wbuft);
    std::mt19937 rng(1234);
    for (auto &l : layers) {
        fill_experts(l.gate, rng);
        fill_experts(l.up, rng);
        fill_experts(l.down, rng);
    }

    for (int ai = 5; ai < argc; ++ai) {
        const int tokens = atoi(argv[ai]);
        ggml_init_params aparams = {4 * ggml_tensor_overhead() + 1024, nullptr, true};
        ggml_context *actx = ggml_init(aparams);
        ggml_tensor *x = ggml_new_tensor_3d(actx, GGML_TYPE_F32, kHidden, 1, tokens);
        ggml_tensor *ids = ggml_new_tensor_2d(actx, GGML_TYPE_I32, kTopK, tokens);
        ggml_backend_buffer_t abuf = ggml_backend_alloc_ctx_tensors(actx, backend);
        std::normal_distribution<float> normal(0.f, 1.f);
        std::vector<float> xv((size_t)kHidden * tokens);
        for (auto &v : xv) v = normal(rng);
        ggml_backend_tensor_set(x, xv.data(), 0, xv.size() * sizeof(float));

        std::vector<ggml_context *> gctx(kLayers);
        std::vector<ggml_cgraph *> graphs(kLayers);
        std::vector<ggml_gallocr_t> gallocs(kLayers);
        for (int l = 0; l < kLayers; ++l) {
            ggml_init_params gparams = {32 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true};
            gctx[l] = ggml_init(gparams);
            ggml_tensor *g = ggml_mul_mat_id(gctx[l], layers[l].gate, x, ids);
            ggml_tensor *u = ggml_mul_mat_id(gctx[l], layers[l].up, x, ids);
            ggml_tensor *d = ggml_mul_mat_id(gctx[l], layers[l].down, ggml_swiglu_split(gctx[l], g, u), ids);
            graphs[l] = ggml_new_graph(gctx[l]);
            ggml_build_forward_expand(graphs[l], d);
            gallocs[l] = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
            ggml_gallocr_alloc_graph(gallocs[l], graphs[l]);
        }

        std::vector<int32_t> route((size_t)kTopK * tokens);
        std::vector<int> order(kExperts);
        std::vector<double> ms;
        double spent = 0;
        for (int call = 0; call < 2 * kLayers || spent < min_seconds || ms.size() < 5; ++call) {
            for (int t = 0; t < tokens; ++t) {
                for (int e = 0; e < kExperts; ++e) order[e] = e;
                std::shuffle(order.begin(), order.end(), rng);
                std::copy(order.begin(), order.begin() + kTopK, route.begin() + (size_t)t * kTopK);
            }
            ggml_backend_tensor_set(ids, route.data(), 0, route.size() * sizeof(int32_t));
            const auto t0 = std::chrono::steady_clock::now();
            ggml_backend_graph_compute(backend, graphs[call % kLayers]);
            const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (call >= 2 * kLayers) {  // the first pass over every layer is warm-up
                ms.push_back(elapsed * 1e3);
                spent += elapsed;
            }
        }
        std::sort(ms.begin(), ms.end());
        printf("{\"impl\": \"ggml\", \"type\": \"%s\", \"repack\": %s, \"threads\": %d, \"tokens\": %d, "
               "\"calls\": %zu, \"median_ms\": %.4f, \"best_ms\": %.4f}\n",
               ggml_type_name(wtype), repack ? "true" : "false", threads, tokens, ms.size(),
               ms[ms.size() / 2], ms[0]);
        fflush(stdout);
        for (int l = 0; l < kLayers; ++l) {
            ggml_gallocr_free(gallocs[l]);
            ggml_free(gctx[l]);
        }
        ggml_backend_buffer_free(abuf);
        ggml_free(actx);
    }
    ggml_backend_buffer_free(wbuf);
    ggml_free(wctx);
    ggml_backend_free(backend);
    ggml_threadpool_free(pool);
    return 0;
}
