"""'Seed' approach (bench_seed.py's idem_call, onconflict mode), C concurrent callers on distinct
keys, one connection per thread (the claim+complete_cC loop: caller w takes w, w+C, ...).

usage: venv/bin/python bench_seed_conc.py sqlite|postgres [N] [C,C,..] [synchronous=FULL]
"""
import json
import os
import sqlite3
import sys
import threading
import time

from common import summarize

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "sqlite"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
CONCS = [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "8,64").split(",")]
RUN = str(int(time.time() * 1000))

if BACKEND == "sqlite":
    SYNC = sys.argv[4] if len(sys.argv) > 4 else "FULL"
    DB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seed_conc.sqlite")
    PEER = f"seed-sqlite-wal-sync{SYNC}-onconflict"
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(DB + suffix)
        except FileNotFoundError:
            pass

    def connect():
        c = sqlite3.connect(DB, isolation_level=None, check_same_thread=False, timeout=10)
        c.execute("PRAGMA journal_mode=WAL")
        c.execute(f"PRAGMA synchronous={SYNC}")
        c.execute("PRAGMA busy_timeout=10000")
        return c
    PH = "?"
    DDL = ("CREATE TABLE IF NOT EXISTS idem (key TEXT PRIMARY KEY, state TEXT NOT NULL, "
           "response TEXT, updated_at REAL NOT NULL)")
else:
    import psycopg
    DSN = "host=127.0.0.1 port=5499 user=postgres dbname=postgres"
    PEER = "seed-postgres-onconflict"

    def connect():
        return psycopg.connect(DSN, autocommit=True)
    PH = "%s"
    DDL = ("CREATE TABLE IF NOT EXISTS idem (key TEXT PRIMARY KEY, state TEXT NOT NULL, "
           "response TEXT, updated_at DOUBLE PRECISION NOT NULL)")

setup = connect()
if BACKEND == "postgres":
    setup.execute("DROP TABLE IF EXISTS idem")
setup.execute(DDL)


class Conflict(Exception):
    pass


body = {"n": 0}
lock = threading.Lock()


def idem_call(conn, key):
    cur = conn.execute(f"INSERT INTO idem(key,state,updated_at) VALUES ({PH},'processing',{PH}) "
                       "ON CONFLICT (key) DO NOTHING", (key, time.time()))
    if cur.rowcount != 1:
        row = conn.execute(f"SELECT state, response FROM idem WHERE key={PH}", (key,)).fetchone()
        if row[0] == "done":
            return json.loads(row[1])
        raise Conflict(key)
    with lock:
        body["n"] += 1
    resp = {"charge_id": "ch_" + key, "amount": 100}
    conn.execute(f"UPDATE idem SET state='done', response={PH}, updated_at={PH} "
                 f"WHERE key={PH} AND state='processing'", (json.dumps(resp), time.time(), key))
    return resp


for C in CONCS:
    conns = [connect() for _ in range(C)]
    lats = [[] for _ in range(C)]
    barrier = threading.Barrier(C + 1)
    body["n"] = 0

    def worker(w):
        c = conns[w]
        barrier.wait()
        for i in range(w, N, C):
            a = time.perf_counter_ns()
            idem_call(c, f"{RUN}-c{C}-{i}")
            lats[w].append(time.perf_counter_ns() - a)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(C)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    summarize(PEER, f"claim+complete_c{C}", [x for l in lats for x in l], wall, {"body_runs": body["n"]})
    for c in conns:
        c.close()
