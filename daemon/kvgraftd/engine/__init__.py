"""The inference engine: the model adapter, the canonical compute path, KV contexts
attended block by block through the tiers, receipts, the native attention kernel
(engine/native), and the engine service behind Generate, Graft, Deposit, Lookup and Verify.

May import kvgraftd.tiers and kvgraftd.store; only model_adapter and native_forward import
transformers.
"""
