-- idemflow: one row per (scope, key), and an append-only history of every transition.
-- Times are integer milliseconds since the Unix epoch, always taken from SQLite's own clock.

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
    -- Bumped by every statement that is a transition; the triggers below write one history row
    -- per bump, inside the same statement, so a transition and its history commit together.
    version          INTEGER NOT NULL,
    last_actor       TEXT    NOT NULL,
    last_reason      TEXT,
    PRIMARY KEY (scope, key),
    CHECK (state <> 'processing' OR lease_expires_at IS NOT NULL),
    CHECK (state = 'processing' OR expires_at IS NOT NULL)
) WITHOUT ROWID;

-- The sweeper's query: stale processing keys by lease expiry. Partial, so its size follows the
-- number of processing keys, not the table.
CREATE INDEX idempotency_keys_stale ON idempotency_keys (lease_expires_at)
    WHERE state = 'processing';

-- Purge: finished keys by expiry.
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at)
    WHERE state <> 'processing';

CREATE TABLE idempotency_key_events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    from_state  TEXT,
    from_retryable INTEGER,
    to_state    TEXT,
    to_retryable INTEGER,
    lease_token INTEGER,
    actor       TEXT    NOT NULL,
    reason      TEXT,
    at          INTEGER NOT NULL
);

CREATE INDEX idempotency_key_events_by_key ON idempotency_key_events (scope, key, id);

CREATE TRIGGER idempotency_keys_history_insert AFTER INSERT ON idempotency_keys
BEGIN
    INSERT INTO idempotency_key_events
        (scope, key, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at)
    VALUES
        (NEW.scope, NEW.key, NULL, NULL, NEW.state, NEW.retryable, NEW.lease_token,
         NEW.last_actor, NEW.last_reason, NEW.updated_at);
END;

CREATE TRIGGER idempotency_keys_history_update AFTER UPDATE ON idempotency_keys
WHEN NEW.version <> OLD.version
BEGIN
    INSERT INTO idempotency_key_events
        (scope, key, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at)
    VALUES
        (NEW.scope, NEW.key, OLD.state, OLD.retryable, NEW.state, NEW.retryable, NEW.lease_token,
         NEW.last_actor, NEW.last_reason, NEW.updated_at);
END;

CREATE TRIGGER idempotency_keys_history_delete AFTER DELETE ON idempotency_keys
BEGIN
    INSERT INTO idempotency_key_events
        (scope, key, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at)
    VALUES
        (OLD.scope, OLD.key, OLD.state, OLD.retryable, NULL, NULL, OLD.lease_token,
         'purge', 'retention expired',
         CAST(unixepoch('subsec') * 1000 AS INTEGER));
END;
