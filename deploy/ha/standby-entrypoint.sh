#!/bin/sh
# The standby: the first time, a base backup of the primary (`pg_basebackup -R` writes
# standby.signal and primary_conninfo, application_name standby1 so the primary's
# synchronous_standby_names names it); then the server, as a hot standby. As the test suite's
# tests/pgpair.py builds its pair.
set -e
export PGPASSWORD="$POSTGRES_PASSWORD"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  until pg_isready -h postgres-primary -U postgres -q; do sleep 1; done
  pg_basebackup -h postgres-primary -U postgres -D "$PGDATA" -R -X stream --checkpoint=fast \
    -d "application_name=standby1"
  chmod 0700 "$PGDATA"
fi
exec postgres -c hot_standby=on
