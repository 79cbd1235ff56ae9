/* cpu_quant_isa.h: the integer operations the x8 kernel bodies (cpu_quant_k8_isa.h, cpu_quant_b8_isa.h) are
 * written in, for one instruction set. No include guard: a kernel file defines X8_ISA_AVX2, X8_ISA_VNNI or
 * X8_ISA_VNNI_EMU, includes this, then the body, inside the set's target region; each inclusion replaces
 * the previous set's macros.
 *   avx2:     maddubs (u8 x s8 pairs into int16; the bodies fold before a lane can pass 32767), then madd
 *             by the scales as int16 pairs;
 *   vnni:     vpdpbusd on 256-bit vectors (AVX-512 VNNI with VL: 4 products into each int32 lane, no int16
 *             stage), then one int32 multiply by the scales;
 *   vnni_emu: the vnni set's arithmetic with AVX2 instructions (vpdpbusd as two madds of the even and odd
 *             bytes widened to int16: exact), so its logic is tested on CPUs without VNNI.
 * All three give the same integer sums (exact) and so, with the bodies' identical f32 steps, the same bits. */
#undef X8_NAME
#undef X8_ACC
#undef X8_FOLD
#undef X8_FOLD1
#undef X8_SCALES_U8
#undef X8_SCALES_I8_PAIRS

#if defined(X8_ISA_AVX2)
#define X8_NAME(n) n##_avx2
#define X8_ACC(acc, w, x) _mm256_add_epi16((acc), _mm256_maddubs_epi16((w), (x)))
#define X8_FOLD(si, acc, sc) _mm256_add_epi32((si), _mm256_madd_epi16((acc), (sc)))
#define X8_FOLD1(si, acc) _mm256_add_epi32((si), _mm256_madd_epi16((acc), _mm256_set1_epi16(1)))
/* the 8 rows' scales as int16 pairs (row s in lanes 2s and 2s + 1, where its pair sums are) */
#define X8_SCALES_U8(p)                                                                                  \
    _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(p)),                         \
                                          _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)))
#define X8_SCALES_I8_PAIRS(v, o)                                                                         \
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8((v), (o) ? _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15) \
                                                   : _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14)))
#elif defined(X8_ISA_VNNI) || defined(X8_ISA_VNNI_EMU)
#if defined(X8_ISA_VNNI)
#define X8_NAME(n) n##_vnni
#define X8_ACC(acc, w, x) _mm256_dpbusd_epi32((acc), (w), (x))
#else
#define X8_NAME(n) n##_vnni_emu
#define X8_ACC(acc, w, x) x8_dpbusd_emu((acc), (w), (x))
#ifndef X8_DPBUSD_EMU
#define X8_DPBUSD_EMU
/* acc + sum over each int32 lane's 4 bytes of u8 a times s8 b, as vpdpbusd (no saturation). */
static inline __m256i x8_dpbusd_emu(__m256i acc, __m256i a, __m256i b) {
    const __m256i ae = _mm256_and_si256(a, _mm256_set1_epi16(0x00FF)), ao = _mm256_srli_epi16(a, 8);
    const __m256i be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), bo = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ae, be), _mm256_madd_epi16(ao, bo)));
}
#endif
#endif
#define X8_FOLD(si, acc, sc) _mm256_add_epi32((si), _mm256_mullo_epi32((acc), (sc)))
#define X8_FOLD1(si, acc) _mm256_add_epi32((si), (acc))
/* the 8 rows' scales as int32 (row s in lane s) */
#define X8_SCALES_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define X8_SCALES_I8_PAIRS(v, o)                                                                         \
    _mm256_cvtepi8_epi32(_mm_shuffle_epi8((v), (o) ? _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15) \
                                                   : _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14)))
#else
#error "cpu_quant_isa.h: define X8_ISA_AVX2, X8_ISA_VNNI or X8_ISA_VNNI_EMU"
#endif
