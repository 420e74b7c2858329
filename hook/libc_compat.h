/*
 * libc_compat.h - the gate loads into any process of the host and of its containers, so it asks
 * nothing of glibc that a libc older than the build machine's lacks.
 *
 * A container's image brings its own libc: a CUDA image on Ubuntu 20.04 has glibc 2.31, one on UBI 8
 * has 2.28. Built on Debian 12 the gate needed GLIBC_2.34 (dlopen and pthread_mutex_trylock moved into
 * libc.so.6 there, under a new version) and GLIBC_2.33 (fstat, an inline wrapper before); built on
 * Ubuntu 24.04 also GLIBC_2.38 (_GNU_SOURCE makes glibc 2.38 redirect strtoul to __isoc23_strtoul).
 * Under an older libc the loader then refuses the library, and a process that /etc/ld.so.preload or
 * LD_PRELOAD names does not start at all. So the gate binds the symbols that moved to their first
 * version (kept by every later glibc) and parses numbers and sizes with the two helpers below.
 *
 * Those symbols are weak, and the gate names no library but libc.so.6: under a glibc before 2.34 they
 * live in libdl.so.2 and libpthread.so.0, which a minimal image may lack (the e2e tier's test image has
 * neither), and a library the loader cannot find also stops every program. A process that uses CUDA
 * has libdl loaded (libcuda and cudart need it); one without libpthread has one thread, where
 * gt_mutex_trylock's plain lock cannot wait.
 * tests/test_gate_build.py fails when the built library needs a version newer than GT_GLIBC_FLOOR.
 */
#ifndef GEMTRACE_LIBC_COMPAT_H
#define GEMTRACE_LIBC_COMPAT_H

#include <stdbool.h>
#include <stdint.h>

#if defined(__x86_64__)
#define GT_GLIBC_FIRST "GLIBC_2.2.5" /* the first version of every symbol on x86_64 */
#elif defined(__aarch64__)
#define GT_GLIBC_FIRST "GLIBC_2.17"
#endif
#define GT_GLIBC_FLOOR "2.17" /* the newest version the gate may need: CentOS 7's, manylinux2014's */

#include <dlfcn.h>
#include <pthread.h>

#ifdef GT_GLIBC_FIRST
#define GT_FIRST_VERSION(name) __asm__(".symver " #name "," #name "@" GT_GLIBC_FIRST)
GT_FIRST_VERSION(dlopen);
GT_FIRST_VERSION(dlclose);
GT_FIRST_VERSION(dlvsym);
GT_FIRST_VERSION(pthread_mutex_trylock);
#undef GT_FIRST_VERSION
#endif
#pragma weak dlopen
#pragma weak dlclose
#pragma weak dlvsym
#pragma weak pthread_mutex_trylock

/* pthread_mutex_trylock where the process has it; else (an old glibc without libpthread loaded: one
 * thread) the lock, which cannot wait. */
static inline int gt_mutex_trylock(pthread_mutex_t *mutex)
{
    return pthread_mutex_trylock ? pthread_mutex_trylock(mutex) : pthread_mutex_lock(mutex);
}

/* The decimal digits at the start of `text`: their value in *value and *end just past them; false
 * when there are none or they do not fit 64 bits. No sign, no leading space (strtoull's). */
bool gt_parse_decimal(const char *text, const char **end, uint64_t *value);

/* The size of the file open on `fd`, or -1. */
int64_t gt_fd_size(int fd);

#endif
