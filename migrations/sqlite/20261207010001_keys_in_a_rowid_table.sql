-- The keys in a rowid table (issue 23, one commit). `idempotency_keys` was a WITHOUT ROWID
-- table: its rows (about 500 bytes with the history in the row) live in an index B-tree, whose
-- interior pages hold whole rows too, so a page held about seven and a new key split pages up
-- a deep tree: a commit carried more pages than its one row. SQLite's own advice is WITHOUT
-- ROWID for rows under about 1/20 of a page. As a rowid table, a new row is appended at the
-- tree's right edge, and the (scope, key) primary key is a small index of its own: fewer pages
-- per new key (`docs/performance.md`). Every statement is unchanged; a read by key goes
-- through the primary key's index.
--
-- The columns, their checks, the partial indexes and the purge's trigger are as before.

CREATE TABLE idempotency_keys_rowid (
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
    last_attempt_at  INTEGER,
    may_have_acted   INTEGER NOT NULL DEFAULT 0 CHECK (may_have_acted IN (0, 1)),
    history          TEXT    NOT NULL DEFAULT '',
    PRIMARY KEY (scope, key),
    CHECK (state <> 'processing' OR lease_expires_at IS NOT NULL),
    CHECK (state = 'processing' OR expires_at IS NOT NULL)
);

INSERT INTO idempotency_keys_rowid (scope, key, operation, provider, provider_key, state,
    retryable, fingerprint, request, response_status, response_headers, response_body, error,
    lease_token, lease_owner, lease_expires_at, attempts, created_at, updated_at, expires_at,
    next_check_at, retention_ms, version, last_attempt_at, may_have_acted, history)
SELECT scope, key, operation, provider, provider_key, state,
    retryable, fingerprint, request, response_status, response_headers, response_body, error,
    lease_token, lease_owner, lease_expires_at, attempts, created_at, updated_at, expires_at,
    next_check_at, retention_ms, version, last_attempt_at, may_have_acted, history
FROM idempotency_keys ORDER BY created_at;

-- Dropping the table drops its indexes and its trigger (which must not archive these rows).
DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_rowid RENAME TO idempotency_keys;

-- The sweeper's query: stale processing keys by lease expiry. Partial, so its size follows the
-- number of processing keys, not the table.
CREATE INDEX idempotency_keys_stale ON idempotency_keys (lease_expires_at)
    WHERE state = 'processing';

-- Purge: finished keys by expiry.
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at)
    WHERE state <> 'processing';

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
