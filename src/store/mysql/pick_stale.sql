SELECT scope, `key`
FROM idempotency_keys
WHERE state = 'processing'
    AND lease_expires_at <= UTC_TIMESTAMP(6)
    AND (next_check_at IS NULL OR next_check_at <= UTC_TIMESTAMP(6))
    AND (? IS NULL OR scope = ?)
ORDER BY lease_expires_at
LIMIT ?
FOR
UPDATE SKIP LOCKED
