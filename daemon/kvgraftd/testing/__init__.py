"""Test support shipped with the daemon, for tests and benchmarks alike: a kvgraftd in a
process of its own (daemon_process), a local S3 server (s3_server) and the knowledge
library's problem sets (flywheel_problems).

Imports the daemon only as a process and kvgraft as a client; nothing in kvgraftd imports it.
"""
