// compare: run one GGUF file through llama.cpp's public C API (llama.h) on the CPU, for
// benches/python/compare_llama_cpp.py.
//
// Usage:
//   compare MODEL N_THREADS PROMPT_IDS N_GEN [options]
//     MODEL       path of a GGUF file
//     N_THREADS   CPU threads (generation and prompt)
//     PROMPT_IDS  comma-separated token ids, e.g. 5,300,17
//     N_GEN       tokens to generate greedily (the first comes from the prompt's logits, each
//                 further one from a one-token llama_decode call)
//   options:
//     --logits-out PATH  write the prompt's last-token logits as raw little-endian float32
//                        (n_vocab values) to PATH instead of listing them in the JSON
//     --kv f32|f16       KV-cache type (default f32)
//     --n-ctx N          context size (default: 512, or larger when the prompt and N_GEN need it)
//     --flash-attn on|off|auto  (default off)
//     --warmup N         one-token decode calls run (and then cleared) before the measured run
//                        (default 2)
//     --quiet            only forward llama.cpp's warnings and errors to stderr
//
// Output: one JSON object on stdout:
//   {"n_vocab", "n_prompt", "logits" | "logits_file", "tokens", "prompt_s", "n_decode",
//    "decode_s", "decode_s_per_token", "tg_tps"}
// where n_decode = N_GEN - 1 is the number of timed one-token decode calls (each with its
// argmax). llama.cpp's log goes to stderr. Exit status 2: bad arguments; 3: the model did not
// load; 4: the context could not be made; 5: llama_decode failed.

#include "llama.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

bool g_quiet = false;
int g_last_level = GGML_LOG_LEVEL_INFO;

void log_to_stderr(enum ggml_log_level level, const char * text, void * /*user_data*/) {
    if (level != GGML_LOG_LEVEL_CONT) {
        g_last_level = level;
    }
    if (g_quiet && g_last_level < GGML_LOG_LEVEL_WARN) {
        return;
    }
    std::fputs(text, stderr);
    std::fflush(stderr);
}

[[noreturn]] void usage(const char * msg) {
    std::fprintf(stderr,
                 "compare: %s\n"
                 "usage: compare MODEL N_THREADS PROMPT_IDS N_GEN [--logits-out PATH] "
                 "[--kv f32|f16] [--n-ctx N] [--flash-attn on|off|auto] [--warmup N] [--quiet]\n",
                 msg);
    std::exit(2);
}

long parse_int(const char * s, const char * what) {
    char * end = nullptr;
    errno = 0;
    long v = std::strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0') {
        usage((std::string(what) + " is not an integer: " + s).c_str());
    }
    return v;
}

std::vector<llama_token> parse_tokens(const char * s) {
    std::vector<llama_token> out;
    std::string cur;
    for (const char * p = s;; ++p) {
        if (*p == ',' || *p == '\0') {
            if (cur.empty()) {
                usage("PROMPT_IDS has an empty entry");
            }
            out.push_back(static_cast<llama_token>(parse_int(cur.c_str(), "a prompt token id")));
            cur.clear();
            if (*p == '\0') {
                break;
            }
        } else {
            cur += *p;
        }
    }
    return out;
}

llama_token argmax(const float * logits, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

std::string json_escape(const std::string & s) {
    std::string out;
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
        }
        out += c;
    }
    return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// llama_decode of `tokens` (sequence 0, positions continuing the cache); only the last token's
// logits are computed. Exits with status 5 on failure.
void decode_or_die(llama_context * ctx, std::vector<llama_token> & tokens, const char * what) {
    llama_batch batch = llama_batch_get_one(tokens.data(), static_cast<int32_t>(tokens.size()));
    const int32_t rc = llama_decode(ctx, batch);
    if (rc != 0) {
        std::fprintf(stderr, "compare: llama_decode (%s) returned %d\n", what, rc);
        std::exit(5);
    }
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 5) {
        usage("expected MODEL N_THREADS PROMPT_IDS N_GEN");
    }
    const char * model_path = argv[1];
    const int n_threads = static_cast<int>(parse_int(argv[2], "N_THREADS"));
    std::vector<llama_token> prompt = parse_tokens(argv[3]);
    const int n_gen = static_cast<int>(parse_int(argv[4], "N_GEN"));
    if (n_threads < 1 || n_gen < 1 || prompt.empty()) {
        usage("N_THREADS and N_GEN must be >= 1 and the prompt non-empty");
    }

    std::string logits_out;
    ggml_type kv_type = GGML_TYPE_F32;
    long n_ctx = 0;
    llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    int warmup = 2;
    for (int i = 5; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> const char * {
            if (i + 1 >= argc) {
                usage((a + " needs a value").c_str());
            }
            return argv[++i];
        };
        if (a == "--logits-out") {
            logits_out = value();
        } else if (a == "--kv") {
            const std::string v = value();
            if (v == "f32") {
                kv_type = GGML_TYPE_F32;
            } else if (v == "f16") {
                kv_type = GGML_TYPE_F16;
            } else {
                usage("--kv must be f32 or f16");
            }
        } else if (a == "--n-ctx") {
            n_ctx = parse_int(value(), "--n-ctx");
        } else if (a == "--flash-attn") {
            const std::string v = value();
            if (v == "on") {
                fa = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            } else if (v == "off") {
                fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            } else if (v == "auto") {
                fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
            } else {
                usage("--flash-attn must be on, off or auto");
            }
        } else if (a == "--warmup") {
            warmup = static_cast<int>(parse_int(value(), "--warmup"));
        } else if (a == "--quiet") {
            g_quiet = true;
        } else {
            usage(("unknown option " + a).c_str());
        }
    }
    const long need = static_cast<long>(prompt.size()) + n_gen + warmup;
    if (n_ctx == 0) {
        n_ctx = need > 512 ? need : 512;
    }
    if (n_ctx < need) {
        usage("--n-ctx is smaller than the prompt + N_GEN + warm-up tokens");
    }

    llama_log_set(log_to_stderr, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (model == nullptr) {
        std::fprintf(stderr, "compare: llama_model_load_from_file(%s) failed\n", model_path);
        return 3;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token t : prompt) {
        if (t < 0 || t >= n_vocab) {
            std::fprintf(stderr, "compare: prompt token %d is outside the vocabulary (%d)\n", t,
                         n_vocab);
            return 2;
        }
    }

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = static_cast<uint32_t>(n_ctx);
    cparams.n_batch = static_cast<uint32_t>(prompt.size() > 512 ? prompt.size() : 512);
    cparams.n_ubatch = cparams.n_batch;
    cparams.n_seq_max = 1;
    cparams.n_threads = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.flash_attn_type = fa;
    cparams.type_k = kv_type;
    cparams.type_v = kv_type;
    cparams.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        std::fprintf(stderr, "compare: llama_init_from_model failed\n");
        llama_model_free(model);
        return 4;
    }
    llama_memory_t mem = llama_get_memory(ctx);

    // Warm-up (graph allocation, thread pool start), then an empty cache again.
    if (warmup > 0) {
        std::vector<llama_token> one = {prompt[0]};
        decode_or_die(ctx, one, "warm-up");
        for (int i = 1; i < warmup; ++i) {
            decode_or_die(ctx, one, "warm-up");
        }
        llama_memory_clear(mem, true);
    }

    // Prompt in one batch; keep the last token's logits.
    auto t0 = std::chrono::steady_clock::now();
    decode_or_die(ctx, prompt, "prompt");
    const double prompt_s = seconds_since(t0);
    const float * last = llama_get_logits_ith(ctx, -1);
    if (last == nullptr) {
        std::fprintf(stderr, "compare: no logits for the prompt's last token\n");
        return 5;
    }
    std::vector<float> prompt_logits(last, last + n_vocab);

    // Greedy generation: one llama_decode per token after the first.
    std::vector<llama_token> tokens;
    tokens.push_back(argmax(prompt_logits.data(), n_vocab));
    t0 = std::chrono::steady_clock::now();
    for (int i = 1; i < n_gen; ++i) {
        std::vector<llama_token> one = {tokens.back()};
        decode_or_die(ctx, one, "generation");
        tokens.push_back(argmax(llama_get_logits_ith(ctx, -1), n_vocab));
    }
    const double decode_s = seconds_since(t0);
    const int n_decode = n_gen - 1;

    std::string json = "{\"n_vocab\": " + std::to_string(n_vocab) +
                       ", \"n_prompt\": " + std::to_string(prompt.size()) +
                       ", \"n_threads\": " + std::to_string(n_threads) +
                       ", \"n_ctx\": " + std::to_string(llama_n_ctx(ctx));
    if (!logits_out.empty()) {
        FILE * f = std::fopen(logits_out.c_str(), "wb");
        if (f == nullptr ||
            std::fwrite(prompt_logits.data(), sizeof(float), prompt_logits.size(), f) !=
                prompt_logits.size() ||
            std::fclose(f) != 0) {
            std::fprintf(stderr, "compare: cannot write %s\n", logits_out.c_str());
            return 2;
        }
        json += ", \"logits_file\": \"" + json_escape(logits_out) + "\"";
    } else {
        json += ", \"logits\": [";
        char buf[32];
        for (int i = 0; i < n_vocab; ++i) {
            const float v = prompt_logits[i];
            if (std::isfinite(v)) {
                std::snprintf(buf, sizeof(buf), "%s%.9g", i ? ", " : "", v);
            } else {  // spelled as Python's json module reads them
                std::snprintf(buf, sizeof(buf), "%s%s", i ? ", " : "",
                              std::isnan(v) ? "NaN" : (v > 0 ? "Infinity" : "-Infinity"));
            }
            json += buf;
        }
        json += "]";
    }
    json += ", \"tokens\": [";
    for (size_t i = 0; i < tokens.size(); ++i) {
        json += (i ? ", " : "") + std::to_string(tokens[i]);
    }
    char buf[256];
    std::snprintf(buf, sizeof(buf),
                  "], \"prompt_s\": %.9g, \"n_decode\": %d, \"decode_s\": %.9g, "
                  "\"decode_s_per_token\": %.9g, \"tg_tps\": %.9g}",
                  prompt_s, n_decode, decode_s, n_decode ? decode_s / n_decode : 0.0,
                  n_decode && decode_s > 0 ? n_decode / decode_s : 0.0);
    json += buf;
    std::printf("%s\n", json.c_str());

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
