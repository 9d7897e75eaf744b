-- A lease given back is not renewed (`Store::extend`): the renewal procedure of
-- migration 20261130200001 with `lease_owner IS NOT NULL`. A release clears the owner and cuts
-- the lease to now; a heartbeat's renewal that lands after it (the sweeper renews its batch
-- beside the key in hand) would otherwise hold the released key for another lease.
DROP PROCEDURE idempotency_keys_extend;

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
