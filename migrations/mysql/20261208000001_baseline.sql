-- idemflow on MariaDB / MySQL: the baseline schema. One row per (scope, key), and an
-- append-only history of every transition (written by triggers, inside the statement of the
-- transition). Times are DATETIME(6) in UTC, always taken from the server's UTC_TIMESTAMP(6).
-- Scopes and keys are VARBINARY: compared byte for byte, case-sensitive, no padding rules.

CREATE TABLE idempotency_keys (
    scope            VARBINARY(255) NOT NULL,
    `key`            VARBINARY(255) NOT NULL,
    operation        TEXT        NOT NULL,
    provider         TEXT        NULL,
    provider_key     TEXT        NOT NULL,
    state            VARCHAR(16) NOT NULL CHECK (state IN ('processing', 'done', 'failed')),
    retryable        BOOLEAN     NOT NULL DEFAULT FALSE,
    fingerprint      VARCHAR(255) NOT NULL,
    request          LONGTEXT    NULL,
    response_status  INT         NULL,
    response_headers LONGTEXT    NULL,
    response_body    LONGBLOB    NULL,
    error            TEXT        NULL,
    lease_token      BIGINT      NOT NULL,
    lease_owner      TEXT        NULL,
    lease_expires_at DATETIME(6) NULL,
    attempts         INT         NOT NULL,
    created_at       DATETIME(6) NOT NULL,
    updated_at       DATETIME(6) NOT NULL,
    expires_at       DATETIME(6) NULL,
    next_check_at    DATETIME(6) NULL,
    retention_ms     BIGINT      NOT NULL,
    -- Bumped by every statement that is a transition; the triggers below write one history row
    -- per bump, inside the same statement, so a transition and its history commit together.
    version          BIGINT      NOT NULL,
    last_actor       VARCHAR(16) NOT NULL,
    last_reason      TEXT        NULL,
    -- A random value set by the claim that last won the key (cleared by every other
    -- token-changing transition): how a claimer learns it won without RETURNING.
    claim_nonce      BIGINT      NULL,
    -- When the latest attempt may have sent (a claim, a takeover, a mark before a send), and
    -- whether any attempt may have acted: the sweeper judges search lag and voids from them.
    last_attempt_at  DATETIME(6) NULL,
    may_have_acted   BOOLEAN     NOT NULL DEFAULT FALSE,
    PRIMARY KEY (scope, `key`),
    -- The sweeper's query: processing keys by lease expiry (no partial indexes here; finished
    -- keys sit under other `state` values and are never scanned).
    INDEX idempotency_keys_stale (state, lease_expires_at),
    -- Purge: finished keys by expiry (processing keys have no expiry).
    INDEX idempotency_keys_expiry (expires_at),
    CONSTRAINT idempotency_keys_lease_check CHECK (state <> 'processing' OR lease_expires_at IS NOT NULL),
    CONSTRAINT idempotency_keys_expiry_check CHECK (state = 'processing' OR expires_at IS NOT NULL)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE idempotency_key_events (
    id             BIGINT      NOT NULL AUTO_INCREMENT PRIMARY KEY,
    scope          VARBINARY(255) NOT NULL,
    `key`          VARBINARY(255) NOT NULL,
    from_state     VARCHAR(16) NULL,
    from_retryable BOOLEAN     NULL,
    to_state       VARCHAR(16) NULL,
    to_retryable   BOOLEAN     NULL,
    lease_token    BIGINT      NULL,
    actor          VARCHAR(16) NOT NULL,
    reason         TEXT        NULL,
    at             DATETIME(6) NOT NULL,
    INDEX idempotency_key_events_by_key (scope, `key`, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TRIGGER idempotency_keys_history_insert AFTER INSERT ON idempotency_keys FOR EACH ROW
    INSERT INTO idempotency_key_events
        (scope, `key`, from_state, from_retryable, to_state, to_retryable, lease_token, actor,
         reason, at)
    VALUES
        (NEW.scope, NEW.`key`, NULL, NULL, NEW.state, NEW.retryable, NEW.lease_token,
         NEW.last_actor, NEW.last_reason, NEW.updated_at);

-- `INSERT .. VALUES` inside `IF`, not `INSERT .. SELECT .. WHERE`: InnoDB (with
-- innodb_autoinc_lock_mode = 1, MariaDB's default) takes a table-level AUTO-INC lock for an
-- `INSERT .. SELECT`, which would queue the transitions of different keys on one another.
CREATE TRIGGER idempotency_keys_history_update AFTER UPDATE ON idempotency_keys FOR EACH ROW
BEGIN
    IF NEW.version <> OLD.version THEN
        INSERT INTO idempotency_key_events
            (scope, `key`, from_state, from_retryable, to_state, to_retryable, lease_token, actor,
             reason, at)
        VALUES
            (NEW.scope, NEW.`key`, OLD.state, OLD.retryable, NEW.state, NEW.retryable,
             NEW.lease_token, NEW.last_actor, NEW.last_reason, NEW.updated_at);
    END IF;
END;

CREATE TRIGGER idempotency_keys_history_delete AFTER DELETE ON idempotency_keys FOR EACH ROW
    INSERT INTO idempotency_key_events
        (scope, `key`, from_state, from_retryable, to_state, to_retryable, lease_token, actor,
         reason, at)
    VALUES
        (OLD.scope, OLD.`key`, OLD.state, OLD.retryable, NULL, NULL, OLD.lease_token,
         'purge', 'retention expired', UTC_TIMESTAMP(6));
