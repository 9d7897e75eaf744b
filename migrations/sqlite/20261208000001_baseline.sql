-- idemflow on SQLite: the baseline schema. One row per (scope, key), its history in the row,
-- and a tombstone per purged key. Times are integer milliseconds since the Unix epoch, always
-- taken from SQLite's own clock.
--
-- The keys are a rowid table: a new row is appended at the tree's right edge, and the
-- (scope, key) primary key is a small index of its own, so a commit writes few pages per new
-- key (a WITHOUT ROWID table, whose ~500-byte rows live in the index B-tree, split pages up a
-- deep tree; SQLite advises WITHOUT ROWID only for rows under about 1/20 of a page).

CREATE TABLE idempotency_keys (
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    operation        TEXT    NOT NULL,
    provider         TEXT,
    provider_key     TEXT    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('processing', 'done', 'failed')),
    retryable        INTEGER NOT NULL DEFAULT 0 CHECK (retryable IN (0, 1)),
    fingerprint      TEXT    NOT NULL,
    request          TEXT,
    response_status  INTEGER,
    response_headers TEXT,
    response_body    BLOB,
    error            TEXT,
    lease_token      INTEGER NOT NULL,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    attempts         INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    expires_at       INTEGER,
    next_check_at    INTEGER,
    retention_ms     INTEGER NOT NULL,
    -- The `seq` of the newest entry of `history`: bumped by every statement that is a
    -- transition, which appends that entry in the same statement.
    version          INTEGER NOT NULL,
    -- When the latest attempt may have sent (a claim, a takeover, a mark before a send), and
    -- whether any attempt may have acted: the sweeper judges search lag and voids from them.
    last_attempt_at  INTEGER,
    may_have_acted   INTEGER NOT NULL DEFAULT 0 CHECK (may_have_acted IN (0, 1)),
    -- An entry is `seq|from|from_rt|to|to_rt|token|at_ms|#actor|actor[|reason]` (the Redis
    -- format; reasons with `\` and line feeds escaped), entries separated by line feeds, oldest
    -- first; the column keeps its newest ~14 KB (src/store/sqlite/sql.rs, `append!`).
    history          TEXT    NOT NULL DEFAULT '',
    PRIMARY KEY (scope, key),
    CHECK (state <> 'processing' OR lease_expires_at IS NOT NULL),
    CHECK (state = 'processing' OR expires_at IS NOT NULL)
);

-- The sweeper's query: stale processing keys by lease expiry. Partial, so its size follows the
-- number of processing keys, not the table.
CREATE INDEX idempotency_keys_stale ON idempotency_keys (lease_expires_at)
    WHERE state = 'processing';

-- Purge: finished keys by expiry.
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at)
    WHERE state <> 'processing';

-- A purged key's history and last seq: `inspect` still shows the history of every life of a
-- key, a re-created key continues its numbering, and the claim still knows a key was purged
-- (its provider key rule).
CREATE TABLE idempotency_key_tombstones (
    scope    TEXT    NOT NULL,
    key      TEXT    NOT NULL,
    last_seq INTEGER NOT NULL,
    history  TEXT    NOT NULL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;

-- A purge (the only statement that deletes keys) moves the row's history, with a last entry for
-- the purge, into its tombstone, inside the DELETE.
CREATE TRIGGER idempotency_keys_archive AFTER DELETE ON idempotency_keys
BEGIN
    INSERT INTO idempotency_key_tombstones (scope, key, last_seq, history)
    VALUES (OLD.scope, OLD.key, OLD.version + 1,
        OLD.history || char(10) || (OLD.version + 1) || '|' || OLD.state || '|' || OLD.retryable
        || '|||' || OLD.lease_token || '|' || CAST(unixepoch('subsec') * 1000 AS INTEGER)
        || '|5|purge|retention expired')
    ON CONFLICT (scope, key) DO UPDATE SET last_seq = excluded.last_seq,
        history = CASE WHEN length(idempotency_key_tombstones.history) <= 14336
            THEN idempotency_key_tombstones.history
            ELSE substr(substr(idempotency_key_tombstones.history, -14336),
                instr(substr(idempotency_key_tombstones.history, -14336), char(10)) + 1)
            END || char(10) || excluded.history;
END;
