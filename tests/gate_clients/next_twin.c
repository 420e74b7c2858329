/*
 * next_twin.c - dlsym(RTLD_NEXT) asked from a library, for tests/test_gate.py: built twice, as
 * libtwin_a.so (-DTWIN=1) and libtwin_b.so (-DTWIN=2), both defining twin(). The program links
 * a, then b; a's next_twin() must find b's twin() (2). An interposed dlsym that calls the real one
 * without a tail call makes the real one search after the interposer instead, and finds a's (1).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

int twin(void) { return TWIN; }

#if TWIN == 1
int next_twin(void)
{
    int (*fn)(void) = (int (*)(void))dlsym(RTLD_NEXT, "twin");
    return fn ? fn() : -1;
}
#endif

#ifdef TWIN_MAIN
int next_twin(void);
int main(void)
{
    printf("%d\n", next_twin());
    return 0;
}
#endif
