"""The model's arithmetic: its adapter (`model_adapter`, the only importer of transformers),
its shape (`geometry`), the row-invariant CPU forward (`native_forward`: a decoder layer in
three native calls, `layer_kernels`), its products (`linear`, over `gguf_weights`' blocks),
row-wise operations (`rowwise`) and attention kernels (`decode_attention`), and the native
libraries' loader and constants (`kernel_libraries`; the C is in engine/native).

Imports nothing else of the engine: a forward attends through whatever context it is given
(kvgraftd.engine.attention.kv_context.KvContext, one layer up).
"""
