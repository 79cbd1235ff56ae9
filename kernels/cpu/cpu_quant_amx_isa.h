/* cpu_quant_amx_isa.h: the AMX kernel body (cpu_quant_amx.c), included once per tile unit, inside an AVX2 target
 * region, with these macros:
 *   AMX_NAME(n)                 n suffixed with the unit's name (amx, amx_emu);
 *   AMX_CONFIG(cfg)             loads the tile configuration (amx_cfg_t *);
 *   AMX_RELEASE()               gives the tiles back;
 *   AMX_ZERO(t), AMX_LOAD(t, p, stride), AMX_STORE(t, p, stride), AMX_DPBSSD(c, a, b): tile t (a constant).
 * Tiles (amx_config): 0..3 the sums C of activation tiles 0..3 [16][16] int32; 4 and 5 the operands A (16
 * activation rows x 32 bytes) and B (8 x 64) of a block of 32; 6 and 7 those of a block of 16 (16 x 16, 4 x 64). */

/* C tiles 0..nt-1 = A tiles (16 rows, rb apart, from a + 16 j rb) times the B tile already loaded; stored
 * to C [nt][16][16]. k16: blocks of 16 (tiles 6, 7), else 32 (4, 5). */
#define AMX_ONE(J)                                                                                       \
    do {                                                                                                 \
        AMX_ZERO(J);                                                                                     \
        if (k16) {                                                                                       \
            AMX_LOAD(6, a + (size_t)(16 * (J)) * rb, rb);                                                \
            AMX_DPBSSD(J, 6, 7);                                                                         \
        } else {                                                                                         \
            AMX_LOAD(4, a + (size_t)(16 * (J)) * rb, rb);                                                \
            AMX_DPBSSD(J, 4, 5);                                                                         \
        }                                                                                                \
        AMX_STORE(J, C + 256 * (J), 64);                                                                 \
    } while (0)
static inline void AMX_NAME(amx_tiles)(int nt, bool k16, const int8_t *a, size_t rb, int32_t *C) {
    AMX_ONE(0);
    if (nt > 1) AMX_ONE(1);
    if (nt > 2) AMX_ONE(2);
    if (nt > 3) AMX_ONE(3);
}
#undef AMX_ONE

/* The R activation rows' x8 products with weight rows [o0, o1) (o1 - o0 a multiple of 16; R a multiple of 16,
 * at most XROWS; the rows' quantized data one stride apart). */
void AMX_NAME(cb_cpu_x8_amx)(const cb_weight_t *w, int o0, int o1, const xrow_t *x, int R, float *y, int ldy) {
    assert((o1 - o0) % 16 == 0 && o0 % 8 == 0 && R % 16 == 0 && R >= 16 && R <= XROWS);
    const bool kq = k_quant(w->type);
    const size_t rb = (size_t)(x[1].q - x[0].q); /* the rows' stride (both formats) */
    for (int r = 0; r < R; r++) assert(x[r].q == x[0].q + (size_t)r * rb && x[r].kq == x[0].kq + (size_t)r * rb);
    const int nt = R / 16;
    _Alignas(64) int8_t B[8 * 64];            /* one block of 16 weight rows, unpacked */
    _Alignas(64) int32_t C[XROWS * 16];    /* [R][16] the block dots */
    __m256 acc[XROWS][2], accm[XROWS][2]; /* per row: weight rows 0..7 and 8..15 of the tile */
    amx_cfg_t cfg;
    amx_config(&cfg);
    AMX_CONFIG(&cfg);
    for (int g = o0 / 8; g < o1 / 8; g += 2) {
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = accm[r][0] = accm[r][1] = _mm256_setzero_ps();
        if (!kq) {
            const int off = b8_code_offset(w->type);
            for (int b = 0; b < w->cols / 32; b++) {
                const uint8_t *gb[2] = {b8_group_blk(w, g, b), b8_group_blk(w, g + 1, b)};
                b8_unpack(w->type, gb, B);
                AMX_LOAD(5, B, 64);
                AMX_NAME(amx_tiles)(nt, false, x[0].q + 32 * b, rb, C);
                b8_fold(w->type, off, gb, x, R, b, C, acc, accm);
            }
        } else if (w->type != CB_TYPE_Q6_K) {
            __m256i si[XROWS][2];
            for (int i = 0; i < w->cols / 256; i++) {
                const uint8_t *gb[2] = {k8_group_sb(w, g, i), k8_group_sb(w, g + 1, i)};
                for (int r = 0; r < R; r++) si[r][0] = si[r][1] = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    q4k_unpack(w->type == CB_TYPE_Q5_K, gb, k, B);
                    AMX_LOAD(5, B, 64);
                    AMX_NAME(amx_tiles)(nt, false, x[0].kq + 256 * i + 32 * k, rb, C);
                    q4k_fold(gb, k, R, C, si);
                }
                q4k_finish(gb, x, R, i, si, acc);
            }
        } else {
            __m256i si[XROWS][2];
            for (int i = 0; i < w->cols / 256; i++) {
                const uint8_t *gb[2] = {k8_group_sb(w, g, i), k8_group_sb(w, g + 1, i)};
                for (int r = 0; r < R; r++) si[r][0] = si[r][1] = _mm256_setzero_si256();
                for (int q = 0; q < 16; q++) {
                    q6k_unpack16(gb, q, B);
                    AMX_LOAD(7, B, 64);
                    AMX_NAME(amx_tiles)(nt, true, x[0].kq + 256 * i + 16 * q, rb, C);
                    q6k_fold(gb, x, q, i, R, C, si);
                }
                q6k_finish(gb, x, R, i, si, acc);
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(y + (size_t)r * ldy + 8 * (g + h), kq ? acc[r][h] : _mm256_add_ps(acc[r][h], accm[r][h]));
    }
    AMX_RELEASE();
}
