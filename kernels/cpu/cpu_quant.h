/* cpu_quant: matrix products directly on the stored (quantized) weight blocks, with the activations
 * quantized to int8 per block of 32 and integer dot products (REFERENCE.md §3: the Q8-activation scheme).
 *
 * Weight types: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, read in place from the GGUF mapping (no f32 copy, no repacked
 * copy). Code paths, chosen once at run time from cpuid (cb_cpu_isa_detect) and capped by $CB_CPU_ISA:
 *   avx512   AVX-512 VNNI (vpdpbusd on 512 bits; VBMI byte permutes unpack four blocks per instruction)
 *   avxvnni  AVX-VNNI (vpdpbusd on 256 bits)
 *   avx2     AVX2 (vpmaddubsw + vpmaddwd)
 *   scalar   portable C
 * The intrinsic paths are compiled with target attributes, so a build without -march=native has them all
 * and picks one at run time; every path computes the same integer block sums, so paths differ only in the
 * order of the f32 accumulation of the scaled block sums.
 *
 * Activations. A row of cols floats (cols a multiple of 32) becomes cb_q8_group_t groups of 4 blocks of 32
 * (a last partial group is zero-padded): per block d = max|x| / 127 and q = round(x / d) in -127..127, so
 * |x - d q| <= d / 2 per element; plus, per group, the lane vectors the SIMD kernels read (scales, the
 * d * sum(q) terms of min-carrying types, the offset corrections of offset types). The group layout is the
 * same for every weight type; only the type-specific lane vectors differ, so an activation buffer is
 * prepared for one weight type (cb_cpu_q8_quantize's wtype).
 *
 * Numerics. y[r][o] = sum over blocks b of s_b(o) * d_b(r) * (integer dot of the block's weight quants and
 * activation quants) + the block's min/offset term; the integer parts are exact, the sum is f32. Each
 * output (o, r) has its own accumulator and always the same sequence of operations, whatever the number of
 * rows in the call and whichever rows share it: a row's result is the same bits alone or in any batch (for
 * one code path). The error against f32 activations is only the activation rounding: |y - y_f32| <=
 * sum_b d_b / 2 * sum_{j in b} |w_j| (tests/unit/test_qmatmul.c checks this bound).
 */
#ifndef CB_CPU_QUANT_H
#define CB_CPU_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu/cpu_pool.h"
#include "engine/backend.h"
#include "model/model.h"

typedef enum { CB_CPU_ISA_SCALAR = 0, CB_CPU_ISA_AVX2, CB_CPU_ISA_AVXVNNI, CB_CPU_ISA_AVX512 } cb_cpu_isa_t;

/* The best path this CPU (and OS) runs, capped by $CB_CPU_ISA (scalar|avx2|avxvnni|avx512) when set;
 * computed once, thread-safe. */
cb_cpu_isa_t cb_cpu_isa_detect(void);
/* Whether this CPU can run path isa (scalar: always). */
bool cb_cpu_isa_supported(cb_cpu_isa_t isa);
const char *cb_cpu_isa_name(cb_cpu_isa_t isa);

/* Whether the integer kernels take weights of this type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K). */
bool cb_cpu_qtype_supported(uint32_t type);

/* One group of 4 activation blocks (128 values) of one row. Lane l (0..15) of a 16-lane dot over X (or Y)
 * covers bytes 4l..4l+3 of it: slot l / 4, elements 4(l % 4)..4(l % 4)+3 (X) or 16 + the same (Y). */
typedef struct {
    int8_t qs[128];      /* X = qs[0:64): [slot 0..3][16] elements 0..15 of the slot's block; Y = qs[64:128):
                            elements 16..31; padding slots are 0 */
    float dl[16];        /* lane l: d of slot l/4's block */
    float ml[16];        /* lane l: d * sum(q) / 4 of slot l/4's block (min terms of Q4_1 and Q4_K) */
    int32_t il[2][16];   /* lane start values of the integer dots: Q4_0 (offset 8), Q8_0 (offset 128 on the
                            VNNI paths): il[0] = -offset * (the lane's X + Y quant sum); Q6_K (offset 32):
                            il[0] = -32 * X sum, il[1] = -32 * Y sum; 0 otherwise */
} cb_q8_group_t;

/* Groups per row of cols values. */
static inline int cb_q8_groups(int cols) { return (cols / 32 + 3) / 4; }

/* Quantizes x [n][cols] (cols a multiple of 32) for weights of type wtype on path isa into
 * act [n][cb_q8_groups(cols)] (64-byte aligned). Rows split over the pool when there are many. */
void cb_cpu_q8_quantize(cb_cpu_isa_t isa, uint32_t wtype, const float *x, int n, int cols, cb_q8_group_t *act,
                        cb_pool_t *pool);

/* y[r][o] = w row o · x row r for r in [0, n) and o in [o0, o1), from act [n][cb_q8_groups(w->cols)]
 * prepared for w->type on the same isa (any n; rows go 8 at a time over each weight row). y [n][ldy]. */
void cb_cpu_qdot(cb_cpu_isa_t isa, const cb_weight_t *w, const cb_q8_group_t *act, int n, float *y, int ldy,
                 int o0, int o1);

/* Several products of one x [n][cols] (all parts have w->cols == cols and a supported type): parts[i].y
 * [n][ldy] = x · parts[i].wᵀ. Quantizes x once per weight type into act (>= n * cb_q8_groups(cols) groups),
 * then runs (part, weight rows, activation rows) tiles on the pool. */
void cb_cpu_qmatmul(cb_cpu_isa_t isa, const cb_matmul_part_t *parts, int n_parts, const float *x, int n,
                    cb_q8_group_t *act, cb_pool_t *pool);
#endif
