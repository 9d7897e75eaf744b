-- History in the row (issue 22). Every transition used to write a second row, into
-- idempotency_key_events, through a plpgsql trigger: a heap tuple and an index entry more per
-- transition, and a trigger call on the hot path. Now the statement that makes a transition
-- appends one entry to the row's own `history` column (the row is rewritten by that statement
-- anyway), so a transition and its history are still one statement, and the claim and the finish
-- are plain statements: no trigger, no function.
--
-- An entry is `seq|from|from_rt|to|to_rt|token|at_ms|#actor|actor[|reason]` (the Redis format;
-- reasons with `\` and line feeds escaped), entries are separated by line feeds, oldest first,
-- and the column keeps its newest ~14 KB (src/store/postgres/sql.rs, `append!`). `version` is the
-- `seq` of the newest entry.
--
-- A purge moves the row's history into idempotency_key_tombstones (one row per purged key, its
-- history and last seq): `inspect` still shows the history of every life of a key, a re-created
-- key continues its numbering, and the claim still knows a key was purged (its provider key
-- rule).
--
-- Rows carried forward: each key's events become its row's history (all of them, from every
-- earlier life too, numbered 1, 2, 3, ... in their order), or, for a key with no live row, its
-- tombstone.

ALTER TABLE idempotency_keys ADD COLUMN history text NOT NULL DEFAULT '';

CREATE TABLE idempotency_key_tombstones (
    scope    text COLLATE "C" NOT NULL,
    key      text COLLATE "C" NOT NULL,
    last_seq bigint NOT NULL,
    history  text   NOT NULL,
    PRIMARY KEY (scope, key)
);

CREATE TEMPORARY TABLE idemflow_carried ON COMMIT DROP AS
SELECT scope, key, count(*) AS last_seq,
    string_agg(entry, E'\n' ORDER BY seq) AS history
FROM (
    SELECT scope, key, seq, concat(seq, '|', from_state, '|',
            CASE WHEN from_state IS NULL THEN NULL WHEN from_retryable THEN '1' ELSE '0' END, '|',
            to_state, '|',
            CASE WHEN to_state IS NULL THEN NULL WHEN to_retryable THEN '1' ELSE '0' END, '|',
            lease_token, '|', floor(extract(epoch FROM at) * 1000)::bigint, '|',
            length(actor), '|', actor,
            '|' || replace(replace(left(reason, 512), '\', '\\'), E'\n', '\n')) AS entry
    FROM (
        SELECT *, row_number() OVER (PARTITION BY scope, key ORDER BY id) AS seq
        FROM idempotency_key_events
    ) numbered
) entries
GROUP BY scope, key;

UPDATE idempotency_keys k SET history = c.history, version = c.last_seq
FROM idemflow_carried c WHERE k.scope = c.scope AND k.key = c.key;

INSERT INTO idempotency_key_tombstones (scope, key, last_seq, history)
SELECT c.scope, c.key, c.last_seq, c.history FROM idemflow_carried c
WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.scope = c.scope AND k.key = c.key);

DROP TRIGGER idempotency_keys_history_insert_delete ON idempotency_keys;
DROP TRIGGER idempotency_keys_history_update ON idempotency_keys;
DROP FUNCTION idempotency_keys_history();
DROP FUNCTION idempotency_keys_claim(text, text, text, text, text, text, text, text, bigint,
    bigint, bigint);
DROP FUNCTION idempotency_keys_claim_write(text, text, text, text, text, text, text, text,
    bigint, bigint, bigint, text);
DROP TYPE idempotency_keys_claimed;
DROP TABLE idempotency_key_events;

ALTER TABLE idempotency_keys DROP COLUMN last_actor, DROP COLUMN last_reason,
    ALTER COLUMN history DROP DEFAULT;

-- Room on each page for the row's later versions (the finish, the lease writes), so they stay
-- on its page.
ALTER TABLE idempotency_keys SET (fillfactor = 85);
