/* How fast the amx GEMM's tile loop can go at DiT-XL/2's sizes, with nothing else in it
 * (docs/history.md, "Granite Rapids gets its own entry"): the loop nest of the amx back-end
 * (a_outer, 2 x 2 C tiles: 2 A + 2 B tile loads and 4 tdpbf16ps per K block of 32) over
 * 2048 x 1152 A and a 1152 x 480 B block (15 micro-panels of 32 columns, 1.1 MB, in L2),
 * already packed, random bf16 data, one core; no packing, no rounding, no C written back.
 *   whole K          : 36 K blocks per micro-tile, the 4 C tiles stored after them (kc 1152)
 *   + sink 8         : and an A tile stored to the stack every 8 blocks (sink_every 8)
 *   A direct + sink 8: A's tiles from A's own rows (row stride 2304 bytes), as a_direct
 *   kc_inner 256     : 8 K blocks at a time over the 15 micro-panels (the A tiles stay in L1),
 *                      the fp32 sums loaded and stored around each step (kc_inner 256)
 *   ... no C traffic : the same steps without those loads and stores (not a GEMM: the floor
 *                      of what A from L1 and B from L2 allow)
 *   oneDNN's form    : the block as oneDNN v3.12's brgemm AMX kernel has it (its JIT code, dumped
 *                      with ONEDNN_JIT_DUMP=1 from torch's bf16 matmul): A from its rows, every
 *                      tile loaded with tileloaddt1, in the order A0 B0 B1 . A1 . . ., and the
 *                      next A micro-panel prefetched into L2 (prefetcht1) across the sweep; no sink
 *   ... + sink 8     : and the sink
 *   B in L1, 1 x 3   : B held in L1 instead (stop 60): a group of 3 B tiles (48 columns) x 8 K blocks
 *                      (24 KB) while the 16-row A micro-tiles of a 256-row block stream past it from
 *                      A's rows, 3 C tiles per micro-tile in two sets that alternate, so that one set's
 *                      fp32 sums are stored and the next micro-tile's loaded among the other's products
 *                      (a single set loaded and stored around each micro-tile ran at half the speed)
 * The second line runs 256 rows of A only, so that A stays in L2, for the sink form and this one.
 * The third line has no GEMM's traffic at all: the 2 x 2 block's products alone (tiles never
 * reloaded), then the same block over A and B tiles cycling through n K blocks (4 KB each), so
 * that they come from L1 (n <= 8), L2 (16-128) or further: the rate each level can feed. The
 * fourth: 36-block micro-tiles fed from L2 (one A micro-panel, 15 B micro-panels), with no C
 * store, the 4 C tiles stored after each (to one 4 KB buffer that stays in L1), and that store
 * with the sink every 8 and every 4 blocks.
 * The whole GEMMs cost more (packing B, rounding C to bf16); compare them with these.
 * Build and run (Linux, gcc >= 11, an AMX CPU):
 *   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f bench/amx_feed_ceiling.c -o /tmp/amx_feed_ceiling -lm
 *   /tmp/amx_feed_ceiling        (GFLOP/s per variant, three rounds) */
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

enum { M = 2048, K = 1152, NC = 480, NJ = NC / 32, NKB = K / 32 };

static void fill(uint16_t *p, size_t n) { for (size_t i = 0; i < n; ++i) p[i] = bf16_randn(); }
static float sink[256] __attribute__((aligned(64)));

/* n K blocks into the 4 C tiles: A's block k at a + k * akb, its rows ars elements apart
 * (packed: 32 and 1024; direct: K and 32); B's block k at b + k * 1024 (two 1 KB tiles) */
__attribute__((noinline)) static void blocks(const uint16_t *a, long ars, long akb, const uint16_t *b,
                                             int n, int sink_every)
{
    for (int k = 0; k < n; ++k) {
        const uint16_t *ak = a + k * akb, *bk = b + k * 1024;
        _tile_loadd(4, ak, 2 * ars); _tile_loadd(6, bk, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, bk + 512, 64); _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, ak + 16 * ars, 2 * ars); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        if (sink_every && k % sink_every == sink_every - 1)
            _tile_stored(4, sink, 64);
    }
}

/* blocks in oneDNN's form: npf lines of the next A micro-panel (from pf) prefetched into L2 per block */
__attribute__((noinline)) static void blocks_onednn(const uint16_t *a, long ars, const uint16_t *b, int n,
                                                    int sink_every, const char *pf, int npf)
{
    for (int k = 0; k < n; ++k) {
        const uint16_t *ak = a + k * 32, *bk = b + k * 1024;
        _tile_stream_loadd(4, ak, 2 * ars); _tile_stream_loadd(6, bk, 64); _tile_stream_loadd(7, bk + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_stream_loadd(5, ak + 16 * ars, 2 * ars); _tile_dpbf16ps(1, 4, 7);
        for (int q = 0; q < npf; ++q) _mm_prefetch(pf + (k * npf + q) * 64, _MM_HINT_T1);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        if (sink_every && k % sink_every == sink_every - 1)
            _tile_stored(4, sink, 64);
    }
}
static void c_zero(void) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
static void c_store(float *c) { _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64); }
static void c_load(const float *c) { _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); _tile_loadd(2, c + 512, 64); _tile_loadd(3, c + 768, 64); }

static uint16_t *A, *Apacked, *B;
static int rows = M;                /* the rows of A a pass runs over */
static float *sums;                 /* one micro-panel row's fp32 sums: NJ tiles of 32 x 32 */

/* one pass over A's micro-panels against the B block; step: K blocks per step (NKB: whole K);
 * onednn: in oneDNN's form (A direct, whole K), the next A micro-panel's lines (32 rows of K
 * bf16, contiguous) prefetched over the sweep's blocks */
static double run(int direct, int step, int sink_every, int c_traffic, int onednn)
{
    const int lines = 32 * K * 2 / 64, npf = (lines + NJ * NKB - 1) / (NJ * NKB);
    long done = 0; double t0 = now(), t;
    do {
        for (int i = 0; i < rows / 32; ++i) {
            const uint16_t *ap = direct ? A + (size_t)i * 32 * K : Apacked + (size_t)i * NKB * 1024;
            const long ars = direct ? K : 32, akb = direct ? 32 : 1024;
            const char *next = (const char *)(A + (size_t)((i + 1) % (rows / 32)) * 32 * K);
            for (int k0 = 0; k0 < NKB; k0 += step) {
                const int n = NKB - k0 < step ? NKB - k0 : step;
                for (int j = 0; j < NJ; ++j) {
                    if (k0 && c_traffic) c_load(sums + j * 1024); else c_zero();
                    if (onednn)
                        blocks_onednn(ap, K, B + (size_t)j * NKB * 1024, NKB, sink_every,
                                      next + (size_t)j * NKB * npf * 64, j * NKB * npf < lines ? npf : 0);
                    else
                        blocks(ap + k0 * akb, ars, akb, B + ((size_t)j * NKB + k0) * 1024, n, sink_every);
                    if (c_traffic || k0 + n == NKB) c_store(sums + j * 1024);
                }
            }
            done += (long)NJ * NKB;
        }
        t = now() - t0;
    } while (t < 0.5);
    return 4.0 * 2 * 16 * 16 * 32 * done / t / 1e9;
}

/* B in L1: tile 6 holds A, 7 the B tile of the moment; C set X is tiles 0-2, Y tiles 3-5 */
enum { MC3 = 256, KB3 = 8, NG3 = NC / 48 };
#define A3(i, k) (a + (size_t)(i) * 16 * K + (size_t)(k) * 32)
#define B3(k, j) (bg + ((size_t)(k) * 3 + (j)) * 512)
#define C3(i, j) (cs + ((size_t)(i) * 3 + (j)) * 256)
#define BLOCK3(c0, c1, c2, i, k) do { _tile_loadd(6, A3(i, k), 2 * K); \
        _tile_loadd(7, B3(k, 0), 64); _tile_dpbf16ps(c0, 6, 7); \
        _tile_loadd(7, B3(k, 1), 64); _tile_dpbf16ps(c1, 6, 7); \
        _tile_loadd(7, B3(k, 2), 64); _tile_dpbf16ps(c2, 6, 7); } while (0)
/* micro-tile i on set s*, while set o* stores i - 1's sums (first 3 blocks) and takes i + 1's (last 3) */
#define MICRO3(s0, s1, s2, o0, o1, o2, i) do { \
        for (int k = 0; k < n; ++k) { BLOCK3(s0, s1, s2, i, k); \
            if (i > 0) { if (k == 0) _tile_stored(o0, C3(i - 1, 0), 64); \
                         else if (k == 1) _tile_stored(o1, C3(i - 1, 1), 64); \
                         else if (k == 2) _tile_stored(o2, C3(i - 1, 2), 64); } \
            if (i + 1 < nm) { if (k == n - 3) { if (first) _tile_zero(o0); else _tile_loadd(o0, C3(i + 1, 0), 64); } \
                              else if (k == n - 2) { if (first) _tile_zero(o1); else _tile_loadd(o1, C3(i + 1, 1), 64); } \
                              else if (k == n - 1) { if (first) _tile_zero(o2); else _tile_loadd(o2, C3(i + 1, 2), 64); } } \
        } } while (0)

/* nm (even) micro-tiles of 16 rows from a against one B group's n (>= 3) K blocks at bg */
__attribute__((noinline)) static void sweep3(const uint16_t *a, const uint16_t *bg, int n, float *cs, int nm, int first)
{
    if (first) { _tile_zero(0); _tile_zero(1); _tile_zero(2); }
    else { _tile_loadd(0, C3(0, 0), 64); _tile_loadd(1, C3(0, 1), 64); _tile_loadd(2, C3(0, 2), 64); }
    for (int i = 0; i < nm; i += 2) {
        MICRO3(0, 1, 2, 3, 4, 5, i);
        MICRO3(3, 4, 5, 0, 1, 2, i + 1);
    }
    _tile_stored(3, C3(nm - 1, 0), 64); _tile_stored(4, C3(nm - 1, 1), 64); _tile_stored(5, C3(nm - 1, 2), 64);
}

static uint16_t *Bgroups;           /* the B block as NG3 groups of 48 columns: K blocks of 3 tiles */
static float *sums3;                /* a row block's fp32 sums for one group: MC3 x 48 */

/* blocks of MC3 rows; per block, each B group in K steps of KB3 blocks, a sweep of the rows each */
static double run_b_in_l1(void)
{
    long done = 0; double t0 = now(), t;
    do {
        for (int ic = 0; ic < rows / MC3; ++ic)
            for (int g = 0; g < NG3; ++g)
                for (int k0 = 0; k0 < NKB; k0 += KB3) {
                    const int n = NKB - k0 < KB3 ? NKB - k0 : KB3;
                    sweep3(A + (size_t)ic * MC3 * K + k0 * 32, Bgroups + ((size_t)g * NKB + k0) * 3 * 512,
                           n, sums3, MC3 / 16, k0 == 0);
                    done += (long)(MC3 / 16) * 3 * n;
                }
        t = now() - t0;
    } while (t < 0.5);
    return 2.0 * 16 * 16 * 32 * done / t / 1e9;
}

/* the 2 x 2 block over A and B tiles cycling through nkb K blocks (never a C store) */
__attribute__((noinline)) static double run_resident(int nkb)
{
    long done = 0; double t0 = now(), t;
    do {
        for (int r = 0; r < 256; ++r)
            for (int k = 0; k < nkb; ++k) {
                const uint16_t *ak = Apacked + (size_t)k * 1024, *bk = B + (size_t)k * 1024;
                _tile_loadd(4, ak, 64); _tile_loadd(6, bk, 64); _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, bk + 512, 64); _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, ak + 512, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
        done += 256L * nkb;
        t = now() - t0;
    } while (t < 0.3);
    return 4.0 * 2 * 16 * 16 * 32 * done / t / 1e9;
}

/* the block's products alone: the tile unit's own rate */
__attribute__((noinline)) static double run_products(void)
{
    long done = 0; double t0 = now(), t;
    do {
        for (int r = 0; r < 4096; ++r) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        done += 4096;
        t = now() - t0;
    } while (t < 0.3);
    return 4.0 * 2 * 16 * 16 * 32 * done / t / 1e9;
}

/* micro-tiles of NKB blocks from L2: the A micro-panel against the 15 B micro-panels in turn;
 * store: the C tiles stored after each micro-tile (to one buffer), sink: its period (0: none) */
__attribute__((noinline)) static double run_store(int store, int sink_every)
{
    long done = 0; double t0 = now(), t;
    do {
        for (int j = 0; j < NJ; ++j) {
            c_zero();
            blocks(Apacked, 32, 1024, B + (size_t)j * NKB * 1024, NKB, sink_every);
            if (store) c_store(sums);
        }
        done += (long)NJ * NKB;
        t = now() - t0;
    } while (t < 0.3);
    return 4.0 * 2 * 16 * 16 * 32 * done / t / 1e9;
}

int main(void)
{
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM): no AMX here");
        return 1;
    }
    A = aligned_alloc(4096, (size_t)M * K * 2); Apacked = aligned_alloc(4096, (size_t)M * K * 2);
    B = aligned_alloc(4096, (size_t)K * NC * 2); sums = aligned_alloc(4096, NJ * 4096);
    fill(A, (size_t)M * K); fill(Apacked, (size_t)M * K); fill(B, (size_t)K * NC);
    memset(sums, 0, NJ * 4096);
    Bgroups = aligned_alloc(4096, (size_t)K * NC * 2); fill(Bgroups, (size_t)K * NC);
    sums3 = aligned_alloc(4096, MC3 * 48 * 4); memset(sums3, 0, MC3 * 48 * 4);
    configure();
    printf("GFLOP/s, one core, %d x %d A, %d x %d B block\n", M, K, K, NC);
    for (int round = 0; round < 3; ++round) {
        rows = M;
        printf("whole K %5.0f  + sink 8 %5.0f  A direct + sink 8 %5.0f  kc_inner 256 %5.0f"
               "  ... no C traffic %5.0f  oneDNN's form %5.0f  ... + sink 8 %5.0f  B in L1, 1 x 3 %5.0f\n", run(0, NKB, 0, 1, 0),
               run(0, NKB, 8, 1, 0), run(1, NKB, 8, 1, 0), run(0, 8, 0, 1, 0), run(0, 8, 0, 0, 0),
               run(1, NKB, 0, 1, 1), run(1, NKB, 8, 1, 1), run_b_in_l1());
        rows = MC3;
        printf("  A in L2 (%d rows): A direct + sink 8 %5.0f  B in L1, 1 x 3 %5.0f\n", MC3, run(1, NKB, 8, 1, 0), run_b_in_l1());
        printf("  products alone %5.0f  A and B over n K blocks:", run_products());
        for (int n = 1; n <= 512; n *= 4) printf("  n %d (%d KB) %5.0f", n, 4 * n, run_resident(n));
        printf("\n  36-block micro-tiles from L2: no C store %5.0f  C stored %5.0f  + sink 8 %5.0f  + sink 4 %5.0f\n",
               run_store(0, 0), run_store(1, 0), run_store(1, 8), run_store(1, 4));
    }
    _tile_release();
    return 0;
}
