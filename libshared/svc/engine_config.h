/* engine_config: the engine's options from the stack's configuration (the `engine` section), for the
 * services that run the model (cb-blend, cb-precompute). One place for what they both do.
 *
 * Keys (engine section only: no fallback to common, whose kv_dtype is the KV files' payload):
 *   kv_dtype    the KV pool's values in memory: f16 (default) | f32 (the reference); environment
 *               CB_ENGINE_KV_DTYPE, flag --engine.kv_dtype=...
 *   attn        prefill attention's arithmetic: auto (default: bf16 with AMX, else int16 with VNNI, else
 *               f32) | bf16 (bf16 tiles, f32 sums, on CPUs with AMX-BF16) | int16 (int16 pairs, int32
 *               sums, on CPUs with AVX512-VNNI) | f32 (the reference); environment CB_ENGINE_ATTN, flag
 *               --engine.attn=...
 * config/cacheblend.cfg; docs/engine.md.
 */
#ifndef CB_ENGINE_CONFIG_H
#define CB_ENGINE_CONFIG_H

#include <stddef.h>

#include "engine/engine.h"
#include "wire/config.h"

/* Sets o->kv_dtype from engine.kv_dtype and o->attn from engine.attn (leaves the other fields). 0, or -1 with a clear err for a bad
 * value ("config engine.kv_dtype = 'x': expected f16 or f32"). */
int cb_engine_opts_from_config(const cb_config_t *cfg, cb_engine_opts_t *o, char *err, size_t errlen);
#endif
