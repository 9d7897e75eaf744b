UPDATE idempotency_keys
SET last_attempt_at = UTC_TIMESTAMP(6), may_have_acted = TRUE, updated_at = UTC_TIMESTAMP(6)
WHERE scope = ?
    AND `key` = ?
    AND state = 'processing'
    AND lease_token = ?
