UPDATE idempotency_keys
SET waiters = true
WHERE scope = $1::text
    AND key = $2::text
    AND state = 'processing'
    AND NOT waiters
