SELECT COUNT(*)
FROM idempotency_keys
WHERE state <> 'processing'
    AND expires_at <= UTC_TIMESTAMP(6)
