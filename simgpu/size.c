/*
 * size.c - parsing of sizes such as "16GiB", "8G" or "1000000" (bytes), shared by the simulated
 * libraries (SIMGPU_MEMORY) and the test clients (allocation sizes), so both read sizes alike.
 */
#include "simgpu.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>

uint64_t sim_parse_size(const char *text)
{
    if (!text || !*text)
        return 0;
    errno = 0;
    char *end;
    double v = strtod(text, &end);
    if (errno || end == text || v <= 0)
        return 0;
    while (isspace((unsigned char)*end))
        end++;
    double mult = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mult = 1024.0; break;
    case 'M': mult = 1024.0 * 1024; break;
    case 'G': mult = 1024.0 * 1024 * 1024; break;
    case 'T': mult = 1024.0 * 1024 * 1024 * 1024; break;
    case '\0': return (uint64_t)v;
    case 'B': return end[1] ? 0 : (uint64_t)v;
    default: return 0;
    }
    end++;
    /* "G", "GB", "GiB", "Gi" all mean binary units: GPU memory is quoted that way. */
    if (*end == 'i' || *end == 'I')
        end++;
    if (*end == 'B' || *end == 'b')
        end++;
    return *end ? 0 : (uint64_t)(v * mult);
}
