-- idemflow on PostgreSQL: the baseline schema. One row per (scope, key), its history in the
-- row, and a tombstone per purged key. Times are timestamptz, always taken from the server's
-- statement_timestamp(). Tables are created in the first schema of the connection's
-- search_path.

CREATE TABLE idempotency_keys (
    scope            text COLLATE "C" NOT NULL,
    key              text COLLATE "C" NOT NULL,
    operation        text        NOT NULL,
    provider         text,
    provider_key     text        NOT NULL,
    state            text        NOT NULL CHECK (state IN ('processing', 'done', 'failed')),
    retryable        boolean     NOT NULL DEFAULT false,
    fingerprint      text        NOT NULL,
    request          text,
    response_status  integer,
    response_headers text,
    response_body    bytea,
    error            text,
    lease_token      bigint      NOT NULL,
    lease_owner      text,
    lease_expires_at timestamptz,
    attempts         integer     NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    expires_at       timestamptz,
    next_check_at    timestamptz,
    retention_ms     bigint      NOT NULL,
    -- The `seq` of the newest entry of `history`: bumped by every statement that is a
    -- transition, which appends that entry in the same statement.
    version          bigint      NOT NULL,
    -- When the latest attempt may have sent (a claim, a takeover, a mark before a send), and
    -- whether any attempt may have acted: the sweeper judges search lag and voids from them.
    last_attempt_at  timestamptz,
    may_have_acted   boolean     NOT NULL DEFAULT false,
    -- An entry is `seq|from|from_rt|to|to_rt|token|at_ms|#actor|actor[|reason]` (the Redis
    -- format; reasons with `\` and line feeds escaped), entries separated by line feeds, oldest
    -- first; the column keeps its newest ~14 KB (src/store/postgres/sql.rs, `append!`).
    history          text        NOT NULL,
    -- Set by a duplicate about to wait for the key's first attempt (`Store::announce_end`): the
    -- write that ends that attempt then publishes the key (trigger below).
    waiters          boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (scope, key),
    CHECK (state <> 'processing' OR lease_expires_at IS NOT NULL),
    CHECK (state = 'processing' OR expires_at IS NOT NULL)
)
-- Room on each page for the row's later versions (the finish, the lease writes), so they stay
-- on its page.
WITH (fillfactor = 85);

-- The sweeper's query: stale processing keys by lease expiry. Partial, so its size follows the
-- number of processing keys, not the table.
CREATE INDEX idempotency_keys_stale ON idempotency_keys (lease_expires_at)
    WHERE state = 'processing';

-- Purge: finished keys by expiry.
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at)
    WHERE state <> 'processing';

-- A purge moves the row's history, with a last entry for the purge, into its tombstone: `inspect`
-- still shows the history of every life of a key, a re-created key continues its numbering, and
-- the claim still knows a key was purged (its provider key rule).
CREATE TABLE idempotency_key_tombstones (
    scope    text COLLATE "C" NOT NULL,
    key      text COLLATE "C" NOT NULL,
    last_seq bigint NOT NULL,
    history  text   NOT NULL,
    PRIMARY KEY (scope, key)
);

-- Announcing ends to waiting duplicates (`wait_in_flight` across processes): the write that
-- ends an attempt a duplicate waits on (a finish or a failure from any state, or a worker's or
-- sweeper's release of its lease) publishes the key on the channel `idemflow_key_ends`
-- (payload: the scope's length in bytes, ':', the scope, the key; src/store/ends.rs), which
-- every process with waiters LISTENs to. The WHEN condition is false for every key nobody waits
-- on, so those writes queue no trigger event and send no NOTIFY: a NOTIFY serialises the commits
-- of the transactions that send one, which the write path must not pay for keys without waiters.
CREATE FUNCTION idemflow_announce_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idemflow_key_ends',
                      octet_length(NEW.scope)::text || ':' || NEW.scope || NEW.key);
    RETURN NULL;
END
$$;

CREATE TRIGGER idemflow_announce_end
    AFTER UPDATE ON idempotency_keys
    FOR EACH ROW
    WHEN (NEW.waiters AND OLD.state = 'processing'
          AND (NEW.state <> 'processing'
               OR (NEW.lease_owner IS NULL AND OLD.lease_owner IS NOT NULL)))
    EXECUTE FUNCTION idemflow_announce_end();
