"""The engine's calls: `engine` (Generate, Graft, Lookup; grafting and decoding),
`passes` (a request's context admitted and its segments computed through the batcher),
`token_stream` (its tokens as the steps choose them), `recompute` (Verify, Graft's fresh
replay), `deposits`, `decoding` (options and events), `token_choice`, `receipts`,
`token_floor`, `service` (the pb-level service) and `tenant_engine` (the engine as one
tenant uses it).

The engine's top room: imports scheduling, attention and model.
"""
