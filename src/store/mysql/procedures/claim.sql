-- The claim, as a stored procedure that `MySqlStore::migrate` creates (`CALL` in `../claim.sql`).
-- A change of this text is a new procedure: bump the version in its name here and in the `CALL`
-- (the test `procedures::a_changed_procedure_has_a_new_name` holds the texts' digests), so that
-- processes of the previous release keep calling the procedure they know during a rolling
-- deploy. To run it in the mariadb client, set another delimiter first (`DELIMITER //`).
--
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
CREATE PROCEDURE IF NOT EXISTS idempotency_keys_claim_v1(
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
      AND NOT IFNULL(fingerprint = p_fingerprint AND ((state = 'failed' AND retryable
          AND (provider <=> p_provider OR NOT may_have_acted))
          OR (state = 'processing' AND provider <=> p_provider
              AND lease_expires_at <= UTC_TIMESTAMP(6)
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
                retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at,
                    attempts,
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
                retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at,
                    attempts,
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
                claim_nonce = IF(IFNULL(fingerprint = p_fingerprint AND ((state = 'failed'
                    AND retryable AND (provider <=> p_provider OR NOT may_have_acted))
                    OR (state = 'processing' AND provider <=> p_provider
                        AND lease_expires_at <= UTC_TIMESTAMP(6)
                        AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)),
                            FALSE),
                    p_nonce, claim_nonce),
                provider_key = IF(claim_nonce <=> p_nonce AND state = 'failed'
                    AND NOT (provider <=> p_provider),
                    IF(p_renewed_key_base IS NULL, p_provider_key,
                        IF(CHAR_LENGTH(provider_key) <= CHAR_LENGTH(p_provider_key), provider_key,
                            CONCAT(p_renewed_key_base,
                                LPAD(LOWER(HEX(v_life & 4294967295)), 8, '0')))),
                    provider_key),
                provider = IF(claim_nonce <=> p_nonce AND state = 'failed', p_provider, provider),
                last_reason = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    IF(state = 'failed', 'reclaimed after a retryable failure',
                        'retry took over an expired lease'), last_reason),
                request = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    COALESCE(p_request, request), request),
                lease_token = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    lease_token + 1, lease_token),
                lease_owner = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    p_owner, lease_owner),
                attempts = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    attempts + 1, attempts),
                updated_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    UTC_TIMESTAMP(6), updated_at),
                expires_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, expires_at),
                next_check_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, next_check_at),
                error = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, error),
                response_status = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, response_status),
                response_headers = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, response_headers),
                response_body = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    NULL, response_body),
                retention_ms = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    p_retention_ms, retention_ms),
                last_actor = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    'worker', last_actor),
                version = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    version + 1, version),
                may_have_acted = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    IF(state = 'failed', may_have_acted, TRUE), may_have_acted),
                last_attempt_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    UTC_TIMESTAMP(6), last_attempt_at),
                lease_expires_at = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    UTC_TIMESTAMP(6) + INTERVAL p_lease_us MICROSECOND, lease_expires_at),
                retryable = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
                    FALSE, retryable),
                state = IF(claim_nonce <=> p_nonce OR IFNULL(fingerprint = p_fingerprint
                    AND ((state = 'failed' AND retryable AND (provider <=> p_provider
                    OR NOT may_have_acted)) OR (state = 'processing' AND provider <=> p_provider
                    AND lease_expires_at <= UTC_TIMESTAMP(6)
                    AND created_at > UTC_TIMESTAMP(6) - INTERVAL p_window_us MICROSECOND)), FALSE),
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
