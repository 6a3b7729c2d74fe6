"""The KV of one inference context (`kv_context`) and how its attention gathers blocks from
wherever they live (`block_gather`: the host cache, the store, the device pool, the live
buffers; `online_softmax`: torch's blockwise softmax where the native kernel does not take
the geometry).

Imports kvgraftd.engine.model (the kernels, the geometry), kvgraftd.tiers and kvgraftd.store.
"""
