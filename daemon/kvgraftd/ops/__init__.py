"""Operations around the server: the command line and configuration file, gRPC's own log
kept quiet, the Prometheus endpoint, systemd notifications, readiness and the data
directory's lock file.

May import kvgraftd.server and below.
"""
