"""Operations around the server: the Prometheus endpoint, systemd notifications,
readiness and the data directory's lock file.

May import kvgraftd.server and below.
"""
