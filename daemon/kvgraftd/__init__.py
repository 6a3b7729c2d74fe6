"""kvgraftd: the kvgraft daemon (store, service, server; later engine, tiers, replication)."""
