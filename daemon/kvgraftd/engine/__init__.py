"""The inference engine, in rooms that import only those below them (import-linter holds it):

    requests     the engine's calls (Generate, Graft, Lookup, Verify, deposits), receipts
    scheduling   the batcher's step loop on the compute thread, admission
    attention    the KV context, its blocks gathered through the tiers
    model        the adapter, the row-invariant forward, its products and kernels

and native/ (the C kernels, one folder per library). May import kvgraftd.tiers and
kvgraftd.store; only model.model_adapter and model.native_forward import transformers.
"""
