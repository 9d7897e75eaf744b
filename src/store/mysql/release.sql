UPDATE idempotency_keys
SET lease_owner = NULL, lease_expires_at = LEAST(lease_expires_at, UTC_TIMESTAMP(6)),
    next_check_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, error = COALESCE(?, error),
    updated_at = UTC_TIMESTAMP(6), version = version + 1, last_actor = ?, last_reason = ?,
    last_attempt_at = IF(? = 'worker', UTC_TIMESTAMP(6), last_attempt_at),
    may_have_acted = (may_have_acted OR ? = 'worker')
WHERE scope = ?
    AND `key` = ?
    AND state = 'processing'
    AND lease_token = ?
