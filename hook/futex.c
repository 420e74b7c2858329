/*
 * futex.c - waits and wakes on futex words shared with the agent and the other gates (the region's
 * control words and assignments, the doorbells). Never FUTEX_PRIVATE: the other side is another
 * process mapping the same memory. Its own file so that attach.c and launch.c both lean on it and
 * not on each other.
 */
#define _GNU_SOURCE
#include "gate.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

void gt_futex_wait(const uint32_t *word, uint32_t expected, uint64_t timeout_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000ull), .tv_nsec = (long)(timeout_ns % 1000000000ull)};
    syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

void gt_futex_wake(const uint32_t *word, int count)
{
    syscall(SYS_futex, word, FUTEX_WAKE, count, NULL, NULL, 0);
}
