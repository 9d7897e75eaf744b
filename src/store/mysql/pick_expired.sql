SELECT scope, `key`
FROM idempotency_keys
WHERE state <> 'processing'
    AND expires_at <= UTC_TIMESTAMP(6)
    AND (? IS NULL OR scope = ?)
ORDER BY expires_at
LIMIT ?
FOR
UPDATE SKIP LOCKED
