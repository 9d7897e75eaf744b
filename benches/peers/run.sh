#!/usr/bin/env bash
# The peers a user would pick instead of idemflow, measured on this machine, so that idemflow's
# own benchmark can be run beside them in the same sitting and compared as ratios.
#   seed-sqlite / seed-postgres : the textbook design (a row per key under a unique
#                                 constraint; claim and answer each autocommitted) in Python
#                                 (sqlite3 with WAL + synchronous=FULL, psycopg 3)
#   node-idempotency-redis      : @node-idempotency/core with its Redis adapter
#   powertools                  : AWS Lambda Powertools (Python) idempotency, Redis persistence
# Each prints JSON lines: {"peer","phase","n","ops_per_s","p50_us","p99_us","max_us",...}.
# Phases: claim+complete (one caller, N new keys), replay (the same keys again),
# claim+complete_c8 / _c64 (8 / 64 concurrent callers on distinct keys), dup64 (64 duplicates).
#
# usage: bash benches/peers/run.sh [N]      (from the repository's root, or from anywhere:
#        it finds its files beside itself; default N=10000; about 5-10 minutes)
# It works in $PEERS_WORK (default /tmp/idemflow-peers): a Python venv and node_modules there
# (installed on first use from the package registries), its own Redis on 127.0.0.1:6399 and
# PostgreSQL on 127.0.0.1:5499 (started here, stopped by pid at the end), results in
# $PEERS_WORK/results/. Compare with `cargo bench --bench throughput` run right before or after.
set -u
N=${1:-10000}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${PEERS_WORK:-/tmp/idemflow-peers}
mkdir -p "$WORK/node" "$WORK/results"
cp "$HERE"/*.py "$WORK/"; cp "$HERE"/node/*.js "$HERE"/node/package*.json "$WORK/node/"
cd "$WORK"
if [ ! -x venv/bin/python ]; then
  python3 -m venv venv && ./venv/bin/pip install -q "aws-lambda-powertools[redis]" redis boto3 jmespath "psycopg[binary]"
fi
[ -d node/node_modules ] || (cd node && npm install --silent)
PGBIN=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
redis-server --port 6399 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
  --pidfile "$WORK/redis6399.pid" --logfile "$WORK/redis6399.log"
mkdir -p "$WORK/pg" && chown postgres:postgres "$WORK/pg"
[ -d "$WORK/pg/data" ] || su postgres -c "$PGBIN/initdb -D $WORK/pg/data -A trust -U postgres" >"$WORK/pg/initdb.log"
su postgres -c "$PGBIN/pg_ctl -D $WORK/pg/data -l $WORK/pg/pg.log -w \
  -o '-p 5499 -c listen_addresses=127.0.0.1 -c unix_socket_directories=$WORK/pg -c max_connections=200' start" >/dev/null
stop() {
  [ -f "$WORK/redis6399.pid" ] && kill "$(cat "$WORK/redis6399.pid")" 2>/dev/null
  su postgres -c "$PGBIN/pg_ctl -D $WORK/pg/data stop -m fast" >/dev/null 2>&1
}
trap stop EXIT
sleep 1
OUT=results/peers_$(date +%Y%m%d-%H%M%S).jsonl
j() { grep -E '^\{' | sed "s/'/\"/g" | tee -a "$OUT"; }
echo "# peers on $(nproc) cores, N=$N, $(date -Is), load $(cut -d' ' -f1-3 /proc/loadavg)"
redis-cli -p 6399 FLUSHALL >/dev/null
timeout 600 ./venv/bin/python bench_seed.py sqlite "$N" FULL "$WORK/seed.sqlite" | j
timeout 600 ./venv/bin/python bench_seed_conc.py sqlite "$N" 8,64 FULL | j
SEED_MODE=onconflict timeout 600 ./venv/bin/python bench_seed.py postgres "$N" "host=127.0.0.1 port=5499 user=postgres dbname=postgres" | j
timeout 600 ./venv/bin/python bench_seed_conc.py postgres "$N" 8,64 | j
(cd node && timeout 600 node bench_node_idem.js "$N" redis 6399) | j
(cd node && timeout 600 node bench_node_idem_conc.js "$N" 8,64 redis 6399) | j
timeout 600 ./venv/bin/python bench_powertools.py "$N" 6399 2>/dev/null | j
echo "# done $(date -Is), load $(cut -d' ' -f1-3 /proc/loadavg) -> $WORK/$OUT"
