/*
 * intercept.c - how a program's calls reach the gate's wrappers, however it finds the driver.
 *
 *  - linked with -lcuda: the wrappers carry the exported names, and LD_PRELOAD puts them first;
 *  - dlsym on a libcuda handle: our dlsym answers gated names with our wrappers;
 *  - cuGetProcAddress(_v2), which is how the CUDA runtime reaches every function (FACTS.md: it fetches
 *    cuGetProcAddress_v2 with dlsym, then everything through it): we ask the real one first, for the
 *    requested version and flags, then hand out our wrapper for whichever real entry point it chose
 *    (matched by address), so version answers stay the driver's own (LESSONS.md: HAMi-core #57).
 * Everything else, cuGetExportTable included, passes straight through untouched.
 */
#define _GNU_SOURCE
#include "gate.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

struct gt_real gt_real;

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym_fn;
static void *libcuda_handle; /* the handle a program looked a gated name up in */

/* glibc 2.34 moved dlsym into libc under a new version; __libc_dlsym is gone (LESSONS.md). */
static dlsym_fn real_dlsym(void)
{
    dlsym_fn fn = __atomic_load_n(&real_dlsym_fn, __ATOMIC_ACQUIRE);
    if (GT_LIKELY(fn != NULL))
        return fn;
    fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!fn)
        fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&real_dlsym_fn, fn, __ATOMIC_RELEASE);
    return fn;
}

static const char *const symbol_names[] = {
#define GT_NAME(name) #name,
    GT_GATED_SYMBOLS(GT_NAME)
#undef GT_NAME
};

static void *const wrappers[] = {
#define GT_WRAPPER(name) (void *)&name,
    GT_GATED_SYMBOLS(GT_WRAPPER)
#undef GT_WRAPPER
};

enum { N_GATED = sizeof symbol_names / sizeof symbol_names[0] };

static void *lookup_real(const char *name)
{
    dlsym_fn lookup = real_dlsym();
    void *handle = __atomic_load_n(&libcuda_handle, __ATOMIC_ACQUIRE);
    void *fn = handle ? lookup(handle, name) : NULL;
    if (!fn) {
        void *loaded = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (loaded) {
            fn = lookup(loaded, name);
            dlclose(loaded); /* drops only the reference NOLOAD took */
        }
    }
    if (!fn)
        fn = lookup(RTLD_NEXT, name);
    return fn;
}

static pthread_mutex_t resolve_lock = PTHREAD_MUTEX_INITIALIZER;

void gt_resolve_real(void)
{
    pthread_mutex_lock(&resolve_lock);
#define GT_RESOLVE(name)                                                                            \
    if (!gt_real.name)                                                                              \
        __atomic_store_n((void **)&gt_real.name, lookup_real(#name), __ATOMIC_RELEASE);
    GT_GATED_SYMBOLS(GT_RESOLVE)
    GT_HELPER_SYMBOLS(GT_RESOLVE)
#undef GT_RESOLVE
    pthread_mutex_unlock(&resolve_lock);
}

static int gated_index_by_name(const char *symbol)
{
    if (!symbol || symbol[0] != 'c' || symbol[1] != 'u')
        return -1;
    for (int i = 0; i < N_GATED; i++)
        if (strcmp(symbol_names[i], symbol) == 0)
            return i;
    return -1;
}

/* Our wrapper for a real entry point the driver handed out, or the pointer itself. */
static void *wrapper_for_real(void *fn)
{
    void *const *reals = (void *const *)&gt_real; /* the gated members come first, in list order */
    for (int i = 0; i < N_GATED; i++)
        if (__atomic_load_n(&reals[i], __ATOMIC_ACQUIRE) == fn)
            return wrappers[i];
    return fn;
}

GT_EXPORT void *dlsym(void *handle, const char *symbol)
{
    dlsym_fn lookup = real_dlsym();
    int gated = gated_index_by_name(symbol);
    if (gated < 0)
        return lookup ? lookup(handle, symbol) : NULL;
    void *fn = lookup(handle, symbol);
    if (!fn)
        return NULL; /* the handle has no such symbol: say so, as the real dlsym would */
    if (handle != RTLD_NEXT && handle != RTLD_DEFAULT)
        __atomic_store_n(&libcuda_handle, handle, __ATOMIC_RELEASE);
    if (fn == wrappers[gated])
        return fn; /* RTLD_DEFAULT found our own export already */
    void **slot = (void **)&gt_real + gated;
    if (!__atomic_load_n(slot, __ATOMIC_ACQUIRE))
        __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
    return wrappers[gated];
}

static void gate_answer(void **pfn)
{
    if (!pfn || !*pfn)
        return;
    gt_resolve_real(); /* reals of every gated symbol, to match what the driver chose */
    *pfn = wrapper_for_real(*pfn);
}

GT_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    if (!GT_REAL(cuGetProcAddress_v2))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = gt_real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS)
        gate_answer(pfn);
    return r;
}

GT_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    if (!GT_REAL(cuGetProcAddress))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = gt_real.cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS)
        gate_answer(pfn);
    return r;
}

/* wrapper_for_real() and dlsym() index gt_real as an array whose first members are the gated list. */
_Static_assert(sizeof(struct gt_real) == sizeof(void *) * (N_GATED + 6), "gt_real: one pointer per listed symbol");
