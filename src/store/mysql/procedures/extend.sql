-- The lease renewal, as a stored procedure that `MySqlStore::migrate` creates (`CALL` in
-- `../extend.sql`); versioned as `claim.sql` in this folder says.
--
-- The lease renewal: the holder's lease only while it still holds the key (not after a release
-- or a finish); the new expiry, or no row when the fence refused it.
CREATE PROCEDURE IF NOT EXISTS idempotency_keys_extend_v1(
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
    UPDATE idempotency_keys
        SET lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL p_lease_us MICROSECOND
    WHERE scope = p_scope AND `key` = p_key AND state = 'processing' AND lease_token = p_token
      AND lease_owner IS NOT NULL;
    IF ROW_COUNT() = 1 THEN
        SELECT lease_expires_at FROM idempotency_keys WHERE scope = p_scope AND `key` = p_key;
    END IF;
    COMMIT;
END;
