/* Counts CUDA driver calls that wait or copy, independently of lowsync, through CUPTI's
 * callback API. Loaded by the driver itself (CUDA_INJECTION64_PATH), so it sees calls made
 * through a dlopen'ed libcuda too; the benchmark reads the counts with ctypes.
 * Build: cc -shared -fPIC -O2 -I<cupti include> cupti_counter.c -L<cupti lib> -lcupti */
#include <cupti.h>
#include <stdatomic.h>
#include <string.h>

/* stream syncs, event syncs, ctx syncs, memcpy, HtoD, DtoH, device to device (same device or
 * peer), stream waits on an event */
static atomic_ulong counts[8];
static CUpti_SubscriberHandle subscriber;
static int initialised;

static void CUPTIAPI on_driver_call(void *user, CUpti_CallbackDomain domain, CUpti_CallbackId id,
                                    const void *data) {
    (void)user;
    (void)domain;
    const CUpti_CallbackData *cb = (const CUpti_CallbackData *)data;
    if (cb->callbackSite != CUPTI_API_ENTER || cb->functionName == NULL) return;
    const char *f = cb->functionName;
    (void)id;
    if (strncmp(f, "cuStreamSynchronize", 19) == 0) atomic_fetch_add(&counts[0], 1);
    else if (strncmp(f, "cuEventSynchronize", 18) == 0) atomic_fetch_add(&counts[1], 1);
    else if (strncmp(f, "cuCtxSynchronize", 16) == 0) atomic_fetch_add(&counts[2], 1);
    else if (strncmp(f, "cuMemcpy", 8) == 0) {
        atomic_fetch_add(&counts[3], 1);
        if (strstr(f, "HtoD") != NULL) atomic_fetch_add(&counts[4], 1);
        if (strstr(f, "DtoH") != NULL) atomic_fetch_add(&counts[5], 1);
        if (strstr(f, "DtoD") != NULL || strstr(f, "Peer") != NULL) atomic_fetch_add(&counts[6], 1);
    } else if (strncmp(f, "cuStreamWaitEvent", 17) == 0) atomic_fetch_add(&counts[7], 1);
}

int InitializeInjection(void) {
    if (initialised) return 1;
    if (cuptiSubscribe(&subscriber, on_driver_call, NULL) != CUPTI_SUCCESS) return 0;
    if (cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API) != CUPTI_SUCCESS) return 0;
    initialised = 1;
    return 1;
}

int lowsync_cupti_active(void) { return initialised; }

void lowsync_cupti_counts(unsigned long *out) {
    for (int i = 0; i < 8; i++) out[i] = atomic_load(&counts[i]);
}
