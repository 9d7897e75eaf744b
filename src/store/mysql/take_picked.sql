UPDATE idempotency_keys
SET last_attempt_at = IF(lease_owner IS NULL, last_attempt_at, GREATEST(COALESCE(last_attempt_at,
    created_at), lease_expires_at)),
    may_have_acted = TRUE, lease_token = lease_token + 1, lease_owner = ?,
    lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, attempts = attempts + 1,
    updated_at = UTC_TIMESTAMP(6), version = version + 1, last_actor = 'sweeper',
    last_reason = 'sweeper took over an expired lease', claim_nonce = NULL
WHERE state = 'processing'
    AND (scope, `key`) IN
