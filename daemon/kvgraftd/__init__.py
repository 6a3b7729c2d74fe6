"""kvgraftd: the kvgraft daemon.

The packages are its layers, each importing only those below it (checked by
import-linter in `make check`; docs/architecture.md has the map):

    main, config   the composition root: settings, and everything built and started
    ops            metrics endpoint, systemd notify, readiness, the lock file
    server         gRPC: method table, error mapping, security, limits, telemetry
    library | replication | remote
    engine         the model, the canonical compute path, receipts
    tiers          device pool, host cache, live buffers
    store          segments, the LMDB index, intake, signing, the store service
"""
