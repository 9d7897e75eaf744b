-- The finish, as a stored procedure that `MySqlStore::migrate` creates (`CALL` in `../finish.sql`);
-- versioned as `claim.sql` in this folder says.
--
-- The finish: the fenced UPDATE and the read of the row it wrote, in one transaction (the row
-- lock is held until the commit, so the row returned is the one written). No row updated (the
-- fence refused it): no result set, nothing written. Any error rolls the transaction back
-- before the error reaches the caller, so no transaction outlives the CALL.
CREATE PROCEDURE IF NOT EXISTS idempotency_keys_finish_v1(
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
