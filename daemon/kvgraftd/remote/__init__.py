"""The remote tier: an S3 bucket behind the local store (write-through or write-back,
read-through for the engine), its health, its upload queue and the remote service behind
RemoteStatus and RemoteSync.

May import kvgraftd.store.
"""
