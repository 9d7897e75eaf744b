SELECT COUNT(*)
FROM idempotency_keys
WHERE state = 'processing'
    AND created_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
