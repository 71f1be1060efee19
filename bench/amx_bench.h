/* What the stand-alone AMX benchmarks in bench/ share: a clock, random bf16 data, and the
 * tile configuration of the amx micro-kernel (8 tiles of 16 rows x 64 bytes). */
#ifndef AUTOHC_AMX_BENCH_H
#define AUTOHC_AMX_BENCH_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static uint64_t rng = 88172645463325252ull;
static double uniform(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (rng >> 11) * (1.0 / 9007199254740992.0); }
static uint16_t bf16_randn(void)    /* a normal deviate, truncated to bf16 */
{
    float f = (float)(sqrt(-2 * log(uniform() + 1e-12)) * cos(6.283185307 * uniform()));
    uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16);
}
static void configure(void)
{
    struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; }
        __attribute__((aligned(64))) c;
    memset(&c, 0, sizeof c); c.palette = 1;
    for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
    _tile_loadconfig(&c);
}
#endif
