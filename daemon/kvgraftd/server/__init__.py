"""The gRPC server: the method table, the one place where errors become status codes,
access control, call limits and traffic telemetry, and what Info and Stats answer.

May import every layer below it (library, replication, remote, engine, tiers, store).
"""
