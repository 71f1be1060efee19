/* The AMX tile-store stall (docs/history.md, "A store in the tile loop"): a stream of 2 x 2
 * tile products (2 A + 2 B tiles per K block of 32, as the amx micro-kernel), A cycling over
 * 16 KB (L1), B over 12 blocks of NKB K blocks (L2), random bf16 data, one core.
 *   none   : no store at all
 *   end    : the 4 C tiles stored (and zeroed) after every NKB K blocks, as a micro-kernel call
 *   sink 8 : the same, plus an A tile stored to a stack line every 8 K blocks (sink_every 8)
 *   vsink 8: the same with a 64-byte vector store instead of the tile store
 * Build and run (Linux, gcc >= 11, an AMX CPU):
 *   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f bench/amx_tile_store.c -o /tmp/amx_tile_store -lm
 *   /tmp/amx_tile_store          (GFLOP/s per variant, three rounds) */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "amx_bench.h"

#define NKB 36          /* K blocks per call: K = 1152, DiT-XL/2's hidden size */
#define NBLK 12         /* B blocks (calls) cycled over */

static float sink[256] __attribute__((aligned(64)));
static __m512i vsink;

/* one call: NKB K blocks into the 4 C tiles; every `every` blocks (0: never) a sink store */
__attribute__((noinline)) static void call(const uint16_t *a, const uint16_t *b, int every, int vector)
{
    for (int k = 0; k < NKB; ++k) {
        const uint16_t *ak = a + (k & 7) * 1024, *bk = b + k * 1024;
        _tile_loadd(4, ak, 64); _tile_loadd(5, ak + 512, 64);
        _tile_loadd(6, bk, 64); _tile_loadd(7, bk + 512, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        if (every && k % every == every - 1) {
            if (vector) _mm512_store_si512(&vsink, _mm512_set1_epi32(k));
            else _tile_stored(4, sink, 64);
        }
    }
}

static double run(int store_c, int every, int vector)
{
    uint16_t *A = aligned_alloc(4096, 16384), *B = aligned_alloc(4096, (size_t)NBLK * NKB * 2048);
    float *C = aligned_alloc(4096, 64 * 4096);
    for (int i = 0; i < 8192; ++i) A[i] = bf16_randn();
    for (size_t i = 0; i < (size_t)NBLK * NKB * 1024; ++i) B[i] = bf16_randn();
    configure();
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    long blocks = 0; int slot = 0; double t0 = now(), t;
    do {
        for (int r = 0; r < 64; ++r)
            for (int j = 0; j < NBLK; ++j) {
                call(A, B + (size_t)j * NKB * 1024, every, vector);
                if (store_c) {
                    float *c = C + (slot++ & 63) * 1024;
                    _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
                    _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                }
                blocks += NKB;
            }
        t = now() - t0;
    } while (t < 0.5);
    _tile_release();
    free(A); free(B); free(C);
    return 4.0 * 2 * 16 * 16 * 32 * blocks / t / 1e9;
}

int main(void)
{
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM): no AMX here");
        return 1;
    }
    printf("GFLOP/s, one core, %d K blocks per call\n", NKB);
    for (int round = 0; round < 3; ++round)
        printf("none %6.0f   end %6.0f   end + sink 8 %6.0f   end + vsink 8 %6.0f\n",
               run(0, 0, 0), run(1, 0, 0), run(1, 8, 0), run(1, 8, 1));
    return 0;
}
