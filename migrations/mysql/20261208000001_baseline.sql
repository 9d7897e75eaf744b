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

-- The claim, the finish and the lease renewal are each one CALL (MySQL has no RETURNING and
-- MariaDB none on UPDATE): a new key in two round trips, a replay in one. Parameters carry the
-- character sets of their columns explicitly: a TEXT parameter would otherwise take the
-- database's default character set and could convert text lossily. A routine runs with the
-- sql_mode it was created with; none depends on the order in which a multi-column SET is
-- assigned, so each is right with or without SIMULTANEOUS_ASSIGNMENT.

-- The claim. The row is read first (a consistent read, no lock): present and not claimable, it
-- is returned as it is and nothing is written (all a replay runs). A key found absent is
-- inserted by a plain INSERT; a key that is there (or was inserted since the read) goes through
-- the INSERT .. ON DUPLICATE KEY UPDATE that decides atomically under the row lock: a claimable
-- row is taken only by the claim that sets `claim_nonce` to its own random value. The row is
-- then read back; the caller compares `claim_nonce` with its nonce. A re-created key's provider
-- key is the base the caller gives and the key's life number (its events plus one, 8 lowercase
-- hex digits): the same after a failover as before, never one an earlier life sent, as in the
-- SQLite, PostgreSQL and Redis claims (`provider_key::renewed`).
CREATE PROCEDURE idempotency_keys_claim(
    IN p_scope        VARBINARY(255),
    IN p_key          VARBINARY(255),
    IN p_operation    TEXT CHARACTER SET utf8mb4,
    IN p_provider     TEXT CHARACTER SET utf8mb4,
    IN p_provider_key TEXT CHARACTER SET utf8mb4,
    IN p_fingerprint  VARCHAR(255) CHARACTER SET utf8mb4,
    IN p_request      LONGTEXT CHARACTER SET utf8mb4,
    IN p_owner        TEXT CHARACTER SET utf8mb4,
    IN p_lease_us     BIGINT,
    IN p_retention_ms BIGINT,
    IN p_window_us    BIGINT,
    IN p_nonce        BIGINT,
    IN p_renewed_key_base TEXT CHARACTER SET utf8mb4)
BEGIN
    DECLARE v_provider_key TEXT CHARACTER SET utf8mb4;
    DECLARE v_duplicate BOOLEAN DEFAULT FALSE;
    DECLARE v_life BIGINT;
    -- A present row that is not claimable: returned as it is (a replay ends here).
    SELECT scope, `key`, operation, provider, provider_key, state, retryable, fingerprint,
        request, response_status, response_headers, response_body, error, lease_token,
        lease_owner, lease_expires_at, attempts, created_at, updated_at, expires_at,
        next_check_at, retention_ms, last_attempt_at, may_have_acted, claim_nonce, last_reason,
        UTC_TIMESTAMP(6) AS db_now
    FROM idempotency_keys
    WHERE scope = p_scope AND `key` = p_key
      AND NOT IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted))
          OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6)
              AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE);
    IF FOUND_ROWS() = 0 THEN
        -- The life number, read only for a derived key (an explicit one is stored as given),
        -- and before the INSERT: its history trigger writes the table a subquery of the
        -- statement may not read (MySQL error 1442).
        IF p_renewed_key_base IS NOT NULL THEN
            SET v_life = (SELECT COUNT(*) FROM idempotency_key_events
                WHERE scope = p_scope AND `key` = p_key) + 1;
        END IF;
        SET v_provider_key = IF(p_renewed_key_base IS NOT NULL AND v_life > 1,
            CONCAT(p_renewed_key_base, LPAD(LOWER(HEX(v_life & 4294967295)), 8, '0')),
            p_provider_key);
        -- A new key: a plain INSERT (error 1062, a duplicate, when a concurrent claim inserted
        -- the key since the read above).
        BEGIN
            DECLARE CONTINUE HANDLER FOR 1062 SET v_duplicate = TRUE;
            INSERT INTO idempotency_keys (scope, `key`, operation, provider, provider_key, state,
                retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts,
                created_at, updated_at, retention_ms, version, last_actor, last_reason, claim_nonce,
                last_attempt_at, may_have_acted)
            VALUES (p_scope, p_key, p_operation, p_provider,
                v_provider_key,
                'processing', FALSE,
                p_fingerprint, p_request,
                TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)), p_owner,
                UTC_TIMESTAMP(6) + INTERVAL p_lease_us MICROSECOND, 1, UTC_TIMESTAMP(6),
                UTC_TIMESTAMP(6), p_retention_ms, 1, 'worker', 'claimed', p_nonce, UTC_TIMESTAMP(6),
                FALSE);
        END;
        -- The key is there after all: the statement of migration 20261201220001 decides under
        -- the row lock, as before.
        IF v_duplicate THEN
            -- The position of the event of a reclaim, read again: the key has a row after all.
            IF p_renewed_key_base IS NOT NULL THEN
                SET v_life = (SELECT COUNT(*) FROM idempotency_key_events
                    WHERE scope = p_scope AND `key` = p_key) + 1;
            END IF;
            INSERT INTO idempotency_keys (scope, `key`, operation, provider, provider_key, state,
                retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts,
                created_at, updated_at, retention_ms, version, last_actor, last_reason, claim_nonce,
                last_attempt_at, may_have_acted)
            VALUES (p_scope, p_key, p_operation, p_provider,
                v_provider_key,
                'processing', FALSE,
                p_fingerprint, p_request,
                TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)), p_owner,
                UTC_TIMESTAMP(6) + INTERVAL p_lease_us MICROSECOND, 1, UTC_TIMESTAMP(6),
                UTC_TIMESTAMP(6), p_retention_ms, 1, 'worker', 'claimed', p_nonce, UTC_TIMESTAMP(6),
                FALSE)
            ON DUPLICATE KEY UPDATE
                claim_nonce = IF(IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted))
                    OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6)
                        AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    p_nonce, claim_nonce),
                provider_key = IF(claim_nonce <=> p_nonce AND state = 'failed' AND NOT (provider <=> p_provider),
                    IF(p_renewed_key_base IS NULL, p_provider_key,
                        IF(CHAR_LENGTH(provider_key) <= CHAR_LENGTH(p_provider_key), provider_key,
                            CONCAT(p_renewed_key_base,
                                LPAD(LOWER(HEX(v_life & 4294967295)), 8, '0')))),
                    provider_key),
                provider = IF(claim_nonce <=> p_nonce AND state = 'failed', p_provider, provider),
                last_reason = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    IF(state = 'failed', 'reclaimed after a retryable failure',
                        'retry took over an expired lease'), last_reason),
                request = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    COALESCE(p_request, request), request),
                lease_token = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    lease_token + 1, lease_token),
                lease_owner = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    p_owner, lease_owner),
                attempts = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    attempts + 1, attempts),
                updated_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    UTC_TIMESTAMP(6), updated_at),
                expires_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, expires_at),
                next_check_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, next_check_at),
                error = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, error),
                response_status = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, response_status),
                response_headers = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, response_headers),
                response_body = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, response_body),
                retention_ms = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    p_retention_ms, retention_ms),
                last_actor = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    'worker', last_actor),
                version = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    version + 1, version),
                may_have_acted = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    IF(state = 'failed', may_have_acted, TRUE), may_have_acted),
                last_attempt_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    UTC_TIMESTAMP(6), last_attempt_at),
                lease_expires_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    UTC_TIMESTAMP(6) + INTERVAL p_lease_us MICROSECOND, lease_expires_at),
                retryable = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    FALSE, retryable),
                state = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable AND (provider <=> p_provider OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider AND lease_expires_at <= UTC_TIMESTAMP(6) AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    'processing', state);
        END IF;
        SELECT scope, `key`, operation, provider, provider_key, state, retryable, fingerprint,
        request, response_status, response_headers, response_body, error, lease_token,
        lease_owner, lease_expires_at, attempts, created_at, updated_at, expires_at,
        next_check_at, retention_ms, last_attempt_at, may_have_acted, claim_nonce, last_reason,
        UTC_TIMESTAMP(6) AS db_now
        FROM idempotency_keys WHERE scope = p_scope AND `key` = p_key;
    END IF;
END;

-- The finish: the fenced UPDATE and the read of the row it wrote, in one transaction (the row
-- lock is held until the commit, so the row returned is the one written). No row updated (the
-- fence refused it): no result set, nothing written. Any error rolls the transaction back
-- before the error reaches the caller, so no transaction outlives the CALL.
CREATE PROCEDURE idempotency_keys_finish(
    IN p_scope    VARBINARY(255),
    IN p_key      VARBINARY(255),
    IN p_state    VARCHAR(16) CHARACTER SET utf8mb4,
    IN p_retryable BOOLEAN,
    IN p_status   INT,
    IN p_headers  LONGTEXT CHARACTER SET utf8mb4,
    IN p_body     LONGBLOB,
    IN p_error    TEXT CHARACTER SET utf8mb4,
    IN p_token    BIGINT,
    IN p_actor    VARCHAR(16) CHARACTER SET utf8mb4,
    IN p_reason   TEXT CHARACTER SET utf8mb4,
    IN p_expect   BIGINT)
BEGIN
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;
    START TRANSACTION;
    UPDATE idempotency_keys SET may_have_acted = IF(p_retryable, FALSE, may_have_acted),
        state = p_state, retryable = p_retryable, response_status = p_status,
        response_headers = p_headers, response_body = p_body, error = p_error,
        lease_token = IF(p_token IS NULL, lease_token + 1, lease_token),
        lease_owner = NULL, lease_expires_at = NULL, updated_at = UTC_TIMESTAMP(6),
        expires_at = UTC_TIMESTAMP(6) + INTERVAL (retention_ms * 1000) MICROSECOND,
        next_check_at = NULL, version = version + 1, last_actor = p_actor,
        last_reason = p_reason, claim_nonce = NULL
    WHERE scope = p_scope AND `key` = p_key
      AND (p_token IS NULL OR (state = 'processing' AND lease_token = p_token))
      AND (p_expect IS NULL OR (state = 'processing' AND lease_token = p_expect));
    IF ROW_COUNT() = 1 THEN
        SELECT scope, `key`, operation, provider, provider_key, state, retryable, fingerprint,
            request, response_status, response_headers, response_body, error, lease_token,
            lease_owner, lease_expires_at, attempts, created_at, updated_at, expires_at,
            next_check_at, retention_ms, last_attempt_at, may_have_acted
        FROM idempotency_keys WHERE scope = p_scope AND `key` = p_key;
    END IF;
    COMMIT;
END;

-- The lease renewal: the holder's lease only while it still holds the key (not after a release
-- or a finish); the new expiry, or no row when the fence refused it.
CREATE PROCEDURE idempotency_keys_extend(
    IN p_scope    VARBINARY(255),
    IN p_key      VARBINARY(255),
    IN p_token    BIGINT,
    IN p_lease_us BIGINT)
BEGIN
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;
    START TRANSACTION;
    UPDATE idempotency_keys SET lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL p_lease_us MICROSECOND
    WHERE scope = p_scope AND `key` = p_key AND state = 'processing' AND lease_token = p_token
      AND lease_owner IS NOT NULL;
    IF ROW_COUNT() = 1 THEN
        SELECT lease_expires_at FROM idempotency_keys WHERE scope = p_scope AND `key` = p_key;
    END IF;
    COMMIT;
END;
