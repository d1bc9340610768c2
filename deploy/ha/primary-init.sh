#!/bin/sh
# Runs once, when the primary's data directory is created (docker-entrypoint-initdb.d): let the
# standby stream from it with the same password as every other connection, and make commits
# wait for it (synchronous replication, from the next start: set here and not on the command
# line, or the entrypoint's own CREATE DATABASE would wait for a standby that cannot exist yet).
set -e
echo "host replication all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
  -c "ALTER SYSTEM SET synchronous_standby_names = 'standby1'"
