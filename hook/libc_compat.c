/* libc_compat.c - the helpers that stand in for libc calls newer builds of glibc version anew
 * (hook/libc_compat.h says why). */
#define _GNU_SOURCE
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gate.h"

bool gt_parse_decimal(const char *text, const char **end, uint64_t *value)
{
    uint64_t v = 0;
    const char *p = text;
    for (; *p >= '0' && *p <= '9'; p++) {
        uint64_t digit = (uint64_t)(*p - '0');
        if (v > (UINT64_MAX - digit) / 10) {
            *end = p;
            return false;
        }
        v = v * 10 + digit;
    }
    *end = p;
    *value = v;
    return p != text;
}

/* fstat by its system call: glibc's fstat is an inline wrapper of __fxstat before 2.33 and a symbol
 * of GLIBC_2.33 after. On x86_64 and aarch64 glibc's struct stat is the kernel's. */
int64_t gt_fd_size(int fd)
{
    struct stat st;
    if (syscall(SYS_fstat, fd, &st) != 0)
        return -1;
    return (int64_t)st.st_size;
}
