/* backend: the table of operations the engine runs, so that a CUDA backend can slot in behind the same calls
 * as the CPU one (docs/engine.md).
 *
 * The table (cb_backend_ops_t, cb_backend_t), the KV block table, the attention geometry and the weight
 * descriptor live on the floor below the model, tensor/tensor.h, where the backends (kernels/cpu,
 * kernels/cuda) implement them without including anything above it. Which backend an engine gets:
 * engine/backend_select.h. This header gathers the table and the model's types for the engine's layers.
 */
#ifndef CB_BACKEND_H
#define CB_BACKEND_H

#include "model/model.h"
#include "tensor/tensor.h"

#endif
