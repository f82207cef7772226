/* Per-kernel device timestamps through CUPTI's activity API, for finding where a decoded
 * token's device time goes when its kernels run inside a CUDA graph (nsys has no importer on
 * the GPU machine). Loaded by the driver (CUDA_INJECTION64_PATH); the script drives it with
 * ctypes: lowsync_ktrace_begin() starts recording, lowsync_ktrace_end(path) flushes and writes
 * one CSV line per kernel: name,start_ns,end_ns,correlation_id (kernels of one cuGraphLaunch
 * share the launch's correlation id).
 * Build: cc -shared -fPIC -O2 -DKREC=<newest CUpti_ActivityKernelN> -I<cupti include> ... */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KREC
#define KREC CUpti_ActivityKernel4
#endif

typedef struct {
    const char *name;
    unsigned long long start, end;
    unsigned corr;
} Rec;

static Rec *recs;
static size_t nrec, cap;
static int recording, initialised;

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = 8 << 20;
    *buf = (uint8_t *)aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                      size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL)
            continue;
        const KREC *k = (const KREC *)r;
        if (!recording) continue;
        if (nrec == cap) {
            cap = cap ? 2 * cap : 1 << 16;
            recs = (Rec *)realloc(recs, cap * sizeof(Rec));
        }
        recs[nrec].name = k->name;
        recs[nrec].start = k->start;
        recs[nrec].end = k->end;
        recs[nrec].corr = k->correlationId;
        ++nrec;
    }
    free(buf);
}

int InitializeInjection(void) {
    if (initialised) return 1;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
    initialised = 1;
    return 1;
}

int lowsync_ktrace_active(void) { return initialised; }

void lowsync_ktrace_begin(void) {
    cuptiActivityFlushAll(1);
    nrec = 0;
    recording = 1;
}

long lowsync_ktrace_end(const char *path) {
    cuptiActivityFlushAll(1);
    recording = 0;
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    for (size_t i = 0; i < nrec; ++i)
        fprintf(f, "%s,%llu,%llu,%u\n", recs[i].name ? recs[i].name : "?", recs[i].start, recs[i].end,
                recs[i].corr);
    fclose(f);
    return (long)nrec;
}
