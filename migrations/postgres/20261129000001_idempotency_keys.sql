-- idemflow on PostgreSQL: one row per (scope, key), and an append-only history of every
-- transition. Times are timestamptz, always taken from the server's statement_timestamp().
-- Tables are created in the first schema of the connection's search_path.

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
    -- Bumped by every statement that is a transition; the trigger below writes one history row
    -- per bump, inside the same statement, so a transition and its history commit together.
    version          bigint      NOT NULL,
    last_actor       text        NOT NULL,
    last_reason      text,
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

CREATE TABLE idempotency_key_events (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope          text COLLATE "C" NOT NULL,
    key            text COLLATE "C" NOT NULL,
    from_state     text,
    from_retryable boolean,
    to_state       text,
    to_retryable   boolean,
    lease_token    bigint,
    actor          text        NOT NULL,
    reason         text,
    at             timestamptz NOT NULL
);

CREATE INDEX idempotency_key_events_by_key ON idempotency_key_events (scope, key, id);

CREATE FUNCTION idempotency_keys_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO idempotency_key_events
            (scope, key, from_state, from_retryable, to_state, to_retryable, lease_token, actor,
             reason, at)
        VALUES
            (OLD.scope, OLD.key, OLD.state, OLD.retryable, NULL, NULL, OLD.lease_token,
             'purge', 'retention expired', statement_timestamp());
        RETURN OLD;
    END IF;
    INSERT INTO idempotency_key_events
        (scope, key, from_state, from_retryable, to_state, to_retryable, lease_token, actor,
         reason, at)
    VALUES
        (NEW.scope, NEW.key,
         CASE WHEN TG_OP = 'UPDATE' THEN OLD.state END,
         CASE WHEN TG_OP = 'UPDATE' THEN OLD.retryable END,
         NEW.state, NEW.retryable, NEW.lease_token, NEW.last_actor, NEW.last_reason,
         NEW.updated_at);
    RETURN NEW;
END
$$;

CREATE TRIGGER idempotency_keys_history_insert_delete AFTER INSERT OR DELETE ON idempotency_keys
    FOR EACH ROW EXECUTE FUNCTION idempotency_keys_history();

CREATE TRIGGER idempotency_keys_history_update AFTER UPDATE ON idempotency_keys
    FOR EACH ROW WHEN (NEW.version <> OLD.version) EXECUTE FUNCTION idempotency_keys_history();
