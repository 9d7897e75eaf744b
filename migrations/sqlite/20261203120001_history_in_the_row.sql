-- History in the row (issue 22). Every transition used to insert a second row, into
-- idempotency_key_events, through a trigger (a page of that table's B-tree more per commit, and a
-- MAX(id) probe). Now the statement that makes a transition appends one entry to the row's own
-- `history` column (the row's page is written by that statement anyway), so a transition and its
-- history are still one statement.
--
-- An entry is `seq|from|from_rt|to|to_rt|token|at_ms|#actor|actor[|reason]` (the Redis format;
-- reasons with `\` and line feeds escaped), entries are separated by line feeds, oldest first,
-- and the column keeps its newest ~14 KB (src/store/sqlite/sql.rs, `append!`). `version` is the
-- `seq` of the newest entry.
--
-- A purge moves the row's history into idempotency_key_tombstones (one row per purged key, its
-- history and last seq): `inspect` still shows the history of every life of a key, a re-created
-- key continues its numbering, and the claim still knows a key was purged (its provider key
-- rule).
--
-- Rows carried forward: each key's events become its row's history (all of them, from every
-- earlier life too, keeping their numbers), or, for a key with no live row, its tombstone.

ALTER TABLE idempotency_keys ADD COLUMN history TEXT NOT NULL DEFAULT '';

CREATE TABLE idempotency_key_tombstones (
    scope    TEXT    NOT NULL,
    key      TEXT    NOT NULL,
    last_seq INTEGER NOT NULL,
    history  TEXT    NOT NULL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;

CREATE TEMPORARY TABLE idemflow_carried AS
SELECT scope, key, MAX(id) AS last_seq,
    group_concat(
        id || '|' || ifnull(from_state, '') || '|'
        || CASE WHEN from_state IS NULL THEN '' WHEN from_retryable THEN '1' ELSE '0' END || '|'
        || ifnull(to_state, '') || '|'
        || CASE WHEN to_state IS NULL THEN '' WHEN to_retryable THEN '1' ELSE '0' END || '|'
        || ifnull(lease_token, '') || '|' || at || '|' || length(actor) || '|' || actor
        || ifnull('|' || replace(replace(substr(reason, 1, 512), '\', '\\'), char(10), '\n'), ''),
        char(10) ORDER BY id) AS history
FROM idempotency_key_events
GROUP BY scope, key;

UPDATE idempotency_keys SET
    history = (SELECT c.history FROM idemflow_carried c
        WHERE c.scope = idempotency_keys.scope AND c.key = idempotency_keys.key),
    version = (SELECT c.last_seq FROM idemflow_carried c
        WHERE c.scope = idempotency_keys.scope AND c.key = idempotency_keys.key)
WHERE EXISTS (SELECT 1 FROM idemflow_carried c
    WHERE c.scope = idempotency_keys.scope AND c.key = idempotency_keys.key);

INSERT INTO idempotency_key_tombstones (scope, key, last_seq, history)
SELECT c.scope, c.key, c.last_seq, c.history FROM idemflow_carried c
WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.scope = c.scope AND k.key = c.key);

DROP TABLE idemflow_carried;

DROP TRIGGER idempotency_keys_history_insert;
DROP TRIGGER idempotency_keys_history_update;
DROP TRIGGER idempotency_keys_history_delete;
DROP TABLE idempotency_key_events;

ALTER TABLE idempotency_keys DROP COLUMN last_actor;
ALTER TABLE idempotency_keys DROP COLUMN last_reason;

-- A purge (the only statement that deletes keys) moves the row's history, with a last entry for
-- the purge, into its tombstone, inside the DELETE. Purges are batched and off the claim and
-- finish path.
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
