"""The artifact store: page segments on disk, the LMDB index (artifacts, page records,
chains, provenance), uploads staged and checked (intake), signing, migration, and the store
service behind the store RPCs.

May import kvgraft (the client's core types) and kvgraftd.config; nothing else of kvgraftd.
"""
