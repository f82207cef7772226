/* Per-kernel device timestamps through CUPTI's activity API, for finding where a decoded
 * token's device time goes when its kernels run inside a CUDA graph (nsys has no importer on
 * the GPU machine). Loaded by the driver (CUDA_INJECTION64_PATH); the script drives it with
 * ctypes: lowsync_ktrace_begin() starts recording, lowsync_ktrace_end(path) flushes and writes
 * one CSV line per kernel: name,start_ns,end_ns,correlation_id (kernels of one cuGraphLaunch
 * share the launch's correlation id). With KTRACE_MEMCPY=1 in the environment it records
 * memory copies too, one line each: memcpy:<HtoD|DtoH|DtoD|other>:<bytes>,start,end,corr (a
 * copy has a correlation id of its own), so that what runs between two graphs shows. With
 * KTRACE_API=1 it records the host's driver calls too, one line each:
 * api:<function>,start,end,corr on the same clock, so a launch shows when the host made it.
 * Build: cc -shared -fPIC -O2 -DKREC=<newest CUpti_ActivityKernelN>
 *        -DMREC=<newest CUpti_ActivityMemcpyN> -I<cupti include> ... */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KREC
#define KREC CUpti_ActivityKernel4
#endif
#ifndef MREC
#define MREC CUpti_ActivityMemcpy5
#endif

typedef struct {
    const char *name;
    unsigned long long start, end;
    unsigned corr;
    int copy;                 /* 1: a memory copy (name unused), 2: a driver call */
    unsigned char copy_kind;
    unsigned long long bytes;
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
        const int kernel =
            r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL;
        const int api = r->kind == CUPTI_ACTIVITY_KIND_DRIVER;
        if ((!kernel && !api && r->kind != CUPTI_ACTIVITY_KIND_MEMCPY) || !recording) continue;
        if (nrec == cap) {
            cap = cap ? 2 * cap : 1 << 16;
            recs = (Rec *)realloc(recs, cap * sizeof(Rec));
        }
        Rec *o = &recs[nrec++];
        memset(o, 0, sizeof *o);
        if (kernel) {
            const KREC *k = (const KREC *)r;
            o->name = k->name;
            o->start = k->start;
            o->end = k->end;
            o->corr = k->correlationId;
        } else if (api) {
            const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)r;
            const char *fn = NULL;
            o->copy = 2;
            if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &fn) == CUPTI_SUCCESS)
                o->name = fn;
            o->start = a->start;
            o->end = a->end;
            o->corr = a->correlationId;
        } else {
            const MREC *m = (const MREC *)r;
            o->copy = 1;
            o->copy_kind = m->copyKind;
            o->bytes = m->bytes;
            o->start = m->start;
            o->end = m->end;
            o->corr = m->correlationId;
        }
    }
    free(buf);
}

int InitializeInjection(void) {
    if (initialised) return 1;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
    const char *mc = getenv("KTRACE_MEMCPY");
    if (mc && strcmp(mc, "1") == 0 && cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS)
        return 0;
    const char *ap = getenv("KTRACE_API");
    if (ap && strcmp(ap, "1") == 0 && cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER) != CUPTI_SUCCESS)
        return 0;
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
    for (size_t i = 0; i < nrec; ++i) {
        const Rec *r = &recs[i];
        if (r->copy == 2) {
            fprintf(f, "api:%s,%llu,%llu,%u\n", r->name ? r->name : "?", r->start, r->end, r->corr);
        } else if (r->copy) {
            const char *kind = r->copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "HtoD"
                               : r->copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "DtoH"
                               : r->copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? "DtoD"
                                                                                 : "other";
            fprintf(f, "memcpy:%s:%llu,%llu,%llu,%u\n", kind, r->bytes, r->start, r->end, r->corr);
        } else {
            fprintf(f, "%s,%llu,%llu,%u\n", r->name ? r->name : "?", r->start, r->end, r->corr);
        }
    }
    fclose(f);
    return (long)nrec;
}
