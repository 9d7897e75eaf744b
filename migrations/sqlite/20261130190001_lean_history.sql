-- Lean history (issue 12): the history table is clustered by key, WITHOUT ROWID, primary key
-- (scope, key, id), where `id` is now the event's number within its key (1, 2, 3, ... across
-- purges and re-creation, since history is kept). Before, every transition wrote three pages
-- beside the key row: the history row (a rowid table), its (scope, key, id) index, and the
-- AUTOINCREMENT counter in sqlite_sequence; now it writes one. The triggers still insert the
-- history row inside the statement that makes the transition, so both commit together.
-- Existing rows keep their ids: they were increasing within each key, so the order is kept and
-- new events continue from the largest.
CREATE TABLE idempotency_key_events_lean (
    scope          TEXT    NOT NULL,
    key            TEXT    NOT NULL,
    id             INTEGER NOT NULL,
    from_state     TEXT,
    from_retryable INTEGER,
    to_state       TEXT,
    to_retryable   INTEGER,
    lease_token    INTEGER,
    actor          TEXT    NOT NULL,
    reason         TEXT,
    at             INTEGER NOT NULL,
    PRIMARY KEY (scope, key, id)
) WITHOUT ROWID;
INSERT INTO idempotency_key_events_lean
    (scope, key, id, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at)
SELECT scope, key, id, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at
FROM idempotency_key_events;
DROP TRIGGER idempotency_keys_history_insert;
DROP TRIGGER idempotency_keys_history_update;
DROP TRIGGER idempotency_keys_history_delete;
DROP TABLE idempotency_key_events;
DELETE FROM sqlite_sequence WHERE name = 'idempotency_key_events';
ALTER TABLE idempotency_key_events_lean RENAME TO idempotency_key_events;
CREATE TRIGGER idempotency_keys_history_insert AFTER INSERT ON idempotency_keys
BEGIN
    INSERT INTO idempotency_key_events
        (scope, key, id, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at)
    VALUES
        (NEW.scope, NEW.key,
         COALESCE((SELECT MAX(id) FROM idempotency_key_events WHERE scope = NEW.scope AND key = NEW.key), 0) + 1,
         NULL, NULL, NEW.state, NEW.retryable, NEW.lease_token,
         NEW.last_actor, NEW.last_reason, NEW.updated_at);
END;
CREATE TRIGGER idempotency_keys_history_update AFTER UPDATE ON idempotency_keys
WHEN NEW.version <> OLD.version
BEGIN
    INSERT INTO idempotency_key_events
        (scope, key, id, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at)
    VALUES
        (NEW.scope, NEW.key,
         COALESCE((SELECT MAX(id) FROM idempotency_key_events WHERE scope = NEW.scope AND key = NEW.key), 0) + 1,
         OLD.state, OLD.retryable, NEW.state, NEW.retryable, NEW.lease_token,
         NEW.last_actor, NEW.last_reason, NEW.updated_at);
END;
CREATE TRIGGER idempotency_keys_history_delete AFTER DELETE ON idempotency_keys
BEGIN
    INSERT INTO idempotency_key_events
        (scope, key, id, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at)
    VALUES
        (OLD.scope, OLD.key,
         COALESCE((SELECT MAX(id) FROM idempotency_key_events WHERE scope = OLD.scope AND key = OLD.key), 0) + 1,
         OLD.state, OLD.retryable, NULL, NULL, OLD.lease_token,
         'purge', 'retention expired',
         CAST(unixepoch('subsec') * 1000 AS INTEGER));
END;
