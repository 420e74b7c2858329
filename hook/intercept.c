/*
 * intercept.c - how a program's calls reach the gate's wrappers, however it finds the driver.
 *
 *  - linked with -lcuda: the wrappers carry the exported names, and LD_PRELOAD puts them first;
 *  - dlsym on a libcuda handle: our dlsym answers gated names with our wrappers;
 *  - cuGetProcAddress(_v2), which is how the CUDA runtime reaches every function: it fetches
 *    cuGetProcAddress_v2 with dlsym on its libcuda handle, then everything through it, whether
 *    cudart is linked statically or shared: so defining cuGetProcAddress_v2 alone would never be
 *    called, and our dlsym must answer that look-up (simgpu/clients/rt.c reaches the simulated
 *    driver the same way, so the tests take this path). We ask the real one first, for the requested version
 *    and flags, then hand out our wrapper for whichever real entry point it chose (matched by
 *    address), so version answers stay the driver's own: always answering the newest _vN broke vLLM
 *    (HAMi-core #57, https://github.com/Project-HAMi/HAMi-core/issues/57).
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

/* glibc 2.34 moved dlsym into libc under a new version and no longer exports __libc_dlsym, which
 * Gemini's src/hook.cpp (https://github.com/NTHU-LSALAB/Gemini) relies on. Guarded: a dlvsym that
 * itself calls dlsym (as another interposer's may) gets NULL instead of recursing: a dlsym hook that
 * recursed crashed HAMi-core on WSL2 (HAMi-core PR #326, https://github.com/Project-HAMi/HAMi-core/pull/326). */
static GT_TLS int finding_dlsym;

static dlsym_fn real_dlsym(void)
{
    dlsym_fn fn = __atomic_load_n(&real_dlsym_fn, __ATOMIC_ACQUIRE);
    if (GT_LIKELY(fn != NULL) || finding_dlsym)
        return fn;
    if (!dlvsym)
        return NULL; /* a glibc before 2.34 without libdl loaded (hook/libc_compat.h): no dlsym to find */
    finding_dlsym = 1;
    fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!fn)
        fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    finding_dlsym = 0;
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
    if (!lookup)
        return NULL;
    void *handle = __atomic_load_n(&libcuda_handle, __ATOMIC_ACQUIRE);
    void *fn = handle ? lookup(handle, name) : NULL;
    if (!fn && dlopen) {
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
static int gt_real_complete; /* 1 once a pass ran with libcuda loaded: what is still NULL, the driver lacks */

void gt_resolve_real(void)
{
    if (__atomic_load_n(&gt_real_complete, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&resolve_lock);
    int found = 0;
#define GT_RESOLVE(name)                                                                            \
    if (!gt_real.name)                                                                              \
        __atomic_store_n((void **)&gt_real.name, lookup_real(#name), __ATOMIC_RELEASE);             \
    found |= gt_real.name != NULL;
    GT_GATED_SYMBOLS(GT_RESOLVE)
    GT_HELPER_SYMBOLS(GT_RESOLVE)
#undef GT_RESOLVE
    /* A symbol the driver does not export (an older driver's) is then looked up once, not on every
     * call; before libcuda is loaded nothing is found and the next call tries again. */
    if (found)
        __atomic_store_n(&gt_real_complete, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&resolve_lock);
}

/* After fork: a thread of the parent may have been resolving; the child has no such thread. What it
 * stored is whole (one atomic store a symbol), and the child's next call finishes the pass. */
static void after_fork_in_child(void) { pthread_mutex_init(&resolve_lock, NULL); }
GT_CONSTRUCTOR_INTERCEPT static void intercept_init(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

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

/* A gated name: our wrapper when what the handle holds is the driver's entry point (or already ours). */
static __attribute__((noinline)) void *answer_gated(void *handle, const char *symbol, int gated, dlsym_fn lookup)
{
    void *fn = lookup(handle, symbol);
    if (!fn)
        return NULL; /* the handle has no such symbol: say so, as the real dlsym would */
    if (fn == wrappers[gated])
        return fn; /* RTLD_DEFAULT found our own export already */
    void **real = (void **)&gt_real + gated;
    if (handle != RTLD_NEXT && handle != RTLD_DEFAULT) {
        /* A library handle, normally libcuda's (maybe from a path of its own): remember it and take
         * the entry point from it. */
        __atomic_store_n(&libcuda_handle, handle, __ATOMIC_RELEASE);
        if (!__atomic_load_n(real, __ATOMIC_ACQUIRE))
            __atomic_store_n(real, fn, __ATOMIC_RELEASE);
    } else {
        /* A search of the global scope may meet another interposer's function: never take it for
         * the driver's (calling it from our wrapper could loop back to us), and hand it out as is. */
        gt_resolve_real();
    }
    return __atomic_load_n(real, __ATOMIC_ACQUIRE) == fn ? wrappers[gated] : fn;
}

/* Everything but the gated names goes to the real dlsym by a tail call, so that the real one sees the
 * program's return address: dlsym(RTLD_NEXT, ...) from another library must search after THAT
 * library, not after us (tests/test_gate.py checks it). The tail call is forced where the compiler
 * can be told to (clang, GCC >= 15: musttail), else by optimising this one function (GCC 12 does the
 * tail call from -O1 on; a -O0 build would otherwise break RTLD_NEXT for every other library). */
#if defined(__has_attribute)
#if __has_attribute(musttail)
#define GT_MUSTTAIL __attribute__((musttail))
#endif
#endif
#ifdef GT_MUSTTAIL
#define GT_TAIL_CALLS
#else
#define GT_MUSTTAIL
#if defined(__GNUC__) && !defined(__clang__)
#define GT_TAIL_CALLS __attribute__((optimize("O2")))
#else
#define GT_TAIL_CALLS
#endif
#endif

GT_EXPORT GT_TAIL_CALLS void *dlsym(void *handle, const char *symbol)
{
    dlsym_fn lookup = real_dlsym();
    if (GT_UNLIKELY(!lookup))
        return NULL;
    int gated = gated_index_by_name(symbol);
    if (gated < 0)
        GT_MUSTTAIL return lookup(handle, symbol);
    return answer_gated(handle, symbol, gated, lookup);
}

static void gate_answer(void **pfn)
{
    if (!pfn || !*pfn)
        return;
    gt_resolve_real(); /* reals of every gated symbol, to match what the driver chose (once) */
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
#define GT_ONE(name) +1
enum { N_HELPERS = 0 GT_HELPER_SYMBOLS(GT_ONE) };
#undef GT_ONE
_Static_assert(sizeof(struct gt_real) == sizeof(void *) * (N_GATED + N_HELPERS), "gt_real: one pointer per listed symbol");
