"""Who computes when: the batcher's step loop (`batcher`: continuous batching, tokens chosen
inside the step), the compute thread it runs on (`compute_thread`) and admission
(`admission`: requests in flight and the live KV they hold).

Knows contexts and decoders only through what it calls on them: imports nothing else of
the engine.
"""
